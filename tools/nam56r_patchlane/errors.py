"""Errors the patch lane raises: a message that says what went wrong and what to do next."""

from __future__ import annotations


class PatchlaneError(Exception):
    """A failure the user can act on. `hint` says what to run next; `exit_code` is the CLI's."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message}\n  -> {self.hint}" if self.hint else self.message


class PatchApplyError(PatchlaneError):
    """A patch did not apply; the tree is left at the last patch that did."""


class WorkAtRiskError(PatchlaneError):
    """The tree holds work (edits or commits) that is not in the series; nothing was changed."""
