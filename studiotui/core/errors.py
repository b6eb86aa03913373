"""One error base for everything a user can act on.

Every layer raises a `StudioError` (or a subclass) with what went wrong and, where it
helps, what to do; the CLI prints both without a traceback, the TUI shows them in the
log and a toast, the API answers with a 4xx and the same words.
"""

from __future__ import annotations


class StudioError(Exception):
    """A problem the user can fix. `hint` says how, when the message alone does not."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


class UserError(StudioError):
    """Bad input or a missing prerequisite on the operator's side."""
