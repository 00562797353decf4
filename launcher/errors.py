"""User errors: each message is one paragraph that names the file, line or key and what was
expected. The CLI catches `UserError` and prints the message without a traceback.

The command's exit codes (launcher.cli; README "Exit codes"):"""

EXIT_USER_ERROR = 2       # a bad spec, model, input, output or launch; records failing for a cause not theirs
EXIT_JOB_FAILED = 3       # replicas failed more often than allowed, or a start-up stage outlived its timeout
EXIT_INTERRUPTED = 130    # Ctrl-C; what finished is in the results file
EXIT_TERMINATED = 143     # SIGTERM (128 + 15), stopped as Ctrl-C stops a run


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the command's handler (launcher.cli), so that a run
    stops as on Ctrl-C: results kept, status `interrupted`, workers and Ray shut down."""


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
