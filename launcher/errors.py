"""User errors: each message is one paragraph that names the file, line or key and what was
expected. The CLI catches `UserError` and prints the message without a traceback.

The command's exit codes (launcher.cli; README "Exit codes"):"""

import re

EXIT_USER_ERROR = 2       # a bad spec, model, input, output or launch; records failing for a cause not theirs
EXIT_JOB_FAILED = 3       # replicas failed more often than allowed, or a start-up stage outlived its timeout
EXIT_DRAINED = 75         # stopped before every record was done (SIGTERM, SIGUSR1, a deadline), the
                          # records in flight finished or given up: run it again to resume (EX_TEMPFAIL)
EXIT_INTERRUPTED = 130    # Ctrl-C; what finished is in the results file
EXIT_TERMINATED = 143     # a second SIGTERM (128 + 15) or SIGUSR1: stopped at once, as Ctrl-C stops a run


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGUSR1, raised in the main thread by the command's handler (launcher.drain.Signals)
    where the run cannot drain: results kept, workers and Ray shut down. `drained`: the first
    signal, before anything was in flight (status `drained`, EXIT_DRAINED); otherwise a second
    signal (status `interrupted`, EXIT_TERMINATED)."""

    def __init__(self, signal_name: str = "SIGTERM", drained: bool = False):
        super().__init__(signal_name)
        self.signal_name, self.drained = signal_name, drained


class UserError(Exception):
    pass


class SpecError(UserError):
    """The job spec (YAML file or --set override) is invalid."""


class InputError(UserError):
    """The input file as a whole cannot be read. Bad single records are not raised: they become
    error records."""


class RecordError(UserError):
    """One record cannot be served (bad sampling override, cannot be encoded). The caller writes
    an error result for it and carries on."""


class OutputError(UserError):
    """The results file or a companion file cannot be written."""


class TokenizerError(UserError):
    """Tokenizer files exist but do not load."""


class SystemicError(UserError):
    """Records fail for a cause that is not theirs (a library the tokenizer needs is missing, a
    file cannot be read): the job stops instead of writing the same error for every record."""


class JobFailed(UserError):
    """Replicas failed more often than fault.max_replica_restarts allows; `reason` says what failed
    the last one."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message


# A replica's start (launcher.replica); here, so that the command catches them without importing
# Ray before it needs it.
class LaunchError(RuntimeError):
    """Workers could not be placed or started; the message says which and why."""


class StartupTimeout(LaunchError):
    """A start-up stage of a replica outlived fault.startup_timeout_s."""


class NoRoom(StartupTimeout):
    """Ray found no room for a replica's workers within fault.startup_timeout_s (a node lost, and
    no other with the resources free)."""


# What MindSpore's "Framework Unexpected Exception" messages say before the error itself
BOILERPLATE = ("This exception is caused by framework's unexpected error",)


def gist(message: str, limit: int | None = 300) -> str:
    """The first informative line of an error (cut to `limit` characters): MindSpore's start with
    rulers, headings and, for a framework error, a request to report it, before the line that
    says what failed."""
    lines = [ln.strip() for ln in message.splitlines()] or [""]
    typed = re.match(r"(\w+):\s*(.*)", lines[0])          # "TypeError: ..." as launcher.engine.describe words it
    head, first = typed.groups() if typed else ("", lines[0])
    body = first or next((ln for ln in lines[1:] if ln and not ln.startswith(("-", "=", *BOILERPLATE))), "")
    text = f"{head}: {body}" if head and body else head or body
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
