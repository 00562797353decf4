"""User errors: each message is one paragraph that names the file, line or key and what was
expected. The CLI catches `UserError` and prints the message without a traceback."""


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
