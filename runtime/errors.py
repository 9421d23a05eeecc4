"""Typed errors of the runtime.

`ValidationError` and its subclasses are raised *before* any state change: they go back to
the caller and the actor that raised them lives on. Any other exception inside an actor
fails the whole runtime (`RuntimeFailed`).
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every error the runtime raises on purpose."""


class CallerError(HiCacheError):
    """An error about one call: it goes back to that caller and the actor lives on."""


class ValidationError(CallerError):
    """Bad input or a call that is not allowed now; nothing was changed."""


class ConfigError(ValidationError):
    """A `RuntimeConfig` field is invalid."""


class UnknownRequestError(ValidationError):
    """The request id is not live (never admitted, or already released)."""


class DuplicateRequestError(ValidationError):
    """The request id is still live."""


class LengthError(ValidationError):
    """A token count or length is empty, misaligned, too large or inconsistent."""


class StateError(ValidationError):
    """The call is not allowed in the object's current state (double finish, busy session...)."""


class CapacityError(ValidationError):
    """Not enough free (or evictable) pages; nothing was allocated."""


class OwnershipError(ValidationError):
    """A slot is not owned by the owner that tried to free or hand it over."""


class PinnedSlotError(ValidationError):
    """A slot with copies in flight (pinned) cannot be freed or reused."""


class MailboxFull(HiCacheError):
    """Explicit back-pressure: the actor's mailbox is full; the message was not sent."""


class TransferError(CallerError):
    """A copy (device<->host, host<->storage) failed; its destination was rolled back."""


class RuntimeClosed(HiCacheError):
    """The runtime is closed (or closing) and takes no more calls."""


class RuntimeFailed(HiCacheError):
    """An actor crashed; the runtime stopped as a whole. `__cause__` holds the original error."""

    def __init__(self, cause: BaseException | None = None) -> None:
        super().__init__(f"runtime failed: {cause!r}")
        self.cause = cause
        self.__cause__ = cause


class InvariantViolation(AssertionError):
    """The debug invariant checker found a broken DESIGN.md invariant (fails the runtime)."""
