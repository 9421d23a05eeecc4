"""Typed errors of the runtime.

`ValidationError` and its subclasses are raised *before* any state change, in a handler's
check phase: they go back to the caller and the actor that raised them lives on. Inside an
actor, anything raised after the check phase (a `ValidationError` included: it would claim
that nothing changed) fails the whole runtime (`RuntimeFailed`), and so does any error that is
not a `CallerError` (the internal structures' own: the radix tree's `TreeError`, a ledger's
`OwnershipError` / `PinnedSlotError`) and any `CallerError` raised for a message that has no
caller to take it (an ack). `runtime.actors.base` says how a handler marks its phases.
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base of every error the runtime raises on purpose."""


class CallerError(HiCacheError):
    """An error about one call: it goes back to that caller and the actor lives on."""


class ValidationError(CallerError):
    """Bad input or a call that is not allowed now; nothing was changed."""


class ArgumentError(ValidationError):
    """A call argument of a type or value the runtime does not take (docs/API.md, "Caller values"):
    an id or namespace that is not a plain key (str, bytes, exact int, tuples of them), a count
    that is not an int, a `step` item that is not a public request. Raised by the façade before
    anything is sent."""


class TokenError(ArgumentError):
    """Token ids that are not integers in range (floats, bools, strings, objects, an id < 0 or
    >= `vocab_size` / 2**31); a wrong shape (empty, not 1-D) is a `LengthError`."""


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


class ForeignLoopError(ValidationError):
    """A call from a thread or event loop other than the one the runtime was opened in. The
    runtime's actors, mailboxes and replies belong to that loop (asyncio objects are not
    thread-safe: a message from elsewhere would not wake it), so nothing was sent. From another
    thread, hand the call to the runtime's loop: ``asyncio.run_coroutine_threadsafe(rt.stats(), loop)``."""


class CapacityError(ValidationError):
    """Not enough free (or evictable) pages; nothing was allocated."""


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


class InternalError(HiCacheError, RuntimeError):
    """The runtime broke its own contract between its parts (an ack for a copy it never issued, a
    release with copies in flight, an internal message a part refused): a bug of the runtime,
    never a caller's input. Fails the runtime whole; never sent to a caller as a refusal."""


class OwnershipError(InternalError):
    """A slot is not owned by the owner that tried to free or hand it over. Raised by a slot
    ledger, which no caller talks to: its arguments are the runtime's own."""


class SlotMisuseError(InternalError):
    """A slot ledger called with arguments no part of the runtime should pass: slots that are not
    whole pages of the pool, a page twice in one call, an unpin of an unpinned page, an unhold of
    an owner not held. The ledger's arguments are the runtime's own (no caller talks to it), so
    this is a bug of the runtime, as `OwnershipError`."""


class PinnedSlotError(InternalError):
    """A slot with copies in flight (pinned) cannot be freed or reused (a ledger's error, as
    `OwnershipError`)."""


class InvariantViolation(AssertionError):
    """The debug invariant checker found a broken invariant (`runtime.invariants`; fails the runtime)."""
