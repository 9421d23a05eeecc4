"""The phase of the handler at hand: checking its message, or changing state.

Errors are classified by where they were raised, not by their type (`runtime.actors.base`): a
`ValidationError` promises that nothing changed, so it may go back to the caller only from the
check phase. The actor's loop calls `begin` before each handler (each item of a batch); the
handler's owner of state (the tree actor's `CacheCore`) calls `change` once the checks passed,
before its first change, and `refuse` to hand back a refusal after undoing every change a caller
could see (or making only changes no caller sees: write-backs started to make room).
"""

from __future__ import annotations

from runtime.errors import CallerError, ValidationError


class Phase:
    """Whether the handler of the message at hand has passed its checks (module docstring)."""

    __slots__ = ("changing",)

    def __init__(self) -> None:
        self.changing = False

    def begin(self) -> None:
        self.changing = False

    def change(self) -> None:
        self.changing = True

    def refuse(self, exc: ValidationError) -> ValidationError:
        """`exc` is a refusal again: the handler rolled back every change the caller could see."""
        self.changing = False
        return exc

    def internal(self, exc: CallerError) -> bool:
        """Whether `exc`, raised by the handler now, is the runtime's own failure."""
        return self.changing and isinstance(exc, ValidationError)
