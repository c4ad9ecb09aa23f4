"""User-facing failures: a one-line message that names what is wrong, plus a hint on how to fix it.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class DraftsmithError(Exception):
    """A failure caused by the user's input or environment, not by a bug in draftsmith."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(DraftsmithError):
    """An option, config field or profile value is invalid."""


class DataError(DraftsmithError):
    """A dataset file or record cannot be read or has the wrong shape."""


class TargetError(DraftsmithError):
    """A target model cannot be found, loaded, or used as asked."""
