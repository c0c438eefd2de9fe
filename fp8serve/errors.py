"""Exceptions that the CLI and server report as one clear line, no traceback."""


class UserError(Exception):
    """An error caused by the user's input; the CLI prints it as one line without a traceback."""


class ConfigError(UserError):
    """A model directory, config field, flag or scale file that cannot be used as given."""


class InvalidParameterError(UserError, ValueError):
    """A request parameter outside its valid range (a ValueError too, as in vLLM).
    `parameter` names the field, so the server can report it as the OpenAI
    error's `param` (vLLM's VLLMValidationError carries the same)."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter
