"""Actor core: mailboxes, reply slots, batch messages and the actor loop.

An actor is an asyncio task with a private mailbox. Callers reach it through a public
handle: `tell` (one-way) or `ask` (a message carrying a `Reply` that the actor completes
with its handler's return value). Handlers are plain methods chosen by message type; they
return the reply value.

Errors are classified by where they were raised, not by their type. A handler first checks its
message (its `Phase` is *checking*), then calls `phase.change()` before its first change. A
`CallerError` raised while checking goes back to the caller (a `ValidationError`: nothing
changed) and the actor lives on. A `ValidationError` raised after `change()` would claim
"nothing changed" when something did: it escapes `run()` and the supervisor fails the whole
runtime. (A `TransferError` after `change()` is the outcome of that call, not a refusal: it goes
back; a handler that undid every change it made may still refuse: `raise phase.refuse(exc)`.)
Anything that is not a `CallerError` fails the runtime too (the tree's and the ledgers' own
errors are `InternalError`s), and so does a `CallerError` raised for a message that has no
reply (an ack: nobody would ever hear of it).

The mailbox is an unbounded queue, so that acks and internal messages never block their
sender (no cycle of blocking sends); the bound applies to external sends: `put_nowait` raises
`MailboxFull` (explicit back-pressure, never a silent drop).
"""

from __future__ import annotations

import asyncio
import types
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio

from runtime.errors import CallerError, MailboxFull, RuntimeClosed
from runtime.messages import Batch
from runtime.phase import Phase

T = TypeVar("T")
M = TypeVar("M")
_Coroutine = types.CoroutineType


class Reply(Generic[T]):
    """The reply slot of one `ask`: a future the actor completes, inspectable by tests.

    If the caller was cancelled while waiting, the actor still handles the message; the
    value it produced is handed to `on_abandon` (set by the façade) so that whatever the
    call took (slots, locks) is released. That happens on whichever side sees it first:
    the actor (future already cancelled when it replies) or the caller (value arrived but
    the caller's task was cancelled before it resumed).
    """

    __slots__ = ("future", "on_abandon", "_abandoned")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, on_abandon: Callable[[Any], None] | None = None) -> None:
        self.future: asyncio.Future[T] = (loop or asyncio.get_running_loop()).create_future()
        self.on_abandon = on_abandon
        self._abandoned = False

    # -- actor side ------------------------------------------------------------
    def set_result(self, value: T) -> None:
        fut = self.future
        if not fut.done():
            fut.set_result(value)
        elif fut.cancelled():
            self._abandon(value)

    def set_exception(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    # -- caller side -----------------------------------------------------------
    async def wait(self) -> T:
        try:
            return await self.future
        except asyncio.CancelledError:
            fut = self.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._abandon(fut.result())
            raise

    # -- inspection --------------------------------------------------------------
    def done(self) -> bool:
        return self.future.done()

    def value(self) -> T:
        return self.future.result()

    def _abandon(self, value: Any) -> None:
        if self._abandoned:
            return
        self._abandoned = True
        if self.on_abandon is not None:
            self.on_abandon(value)


class Mailbox(Generic[M]):
    """A private mailbox: an unbounded queue with a soft capacity for external senders.

    One receiver (its actor) takes whole bursts; it waits on a plain future that the first send
    into an empty mailbox completes, so a wake-up is one resumption of the actor's task (no
    stream checkpoint in between)."""

    __slots__ = ("capacity", "_queue", "_waiter", "_closed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._queue: deque[M] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def closed(self) -> bool:
        return self._closed

    def put_nowait(self, msg: M) -> None:
        """External send: raises `MailboxFull` at capacity, `RuntimeClosed` once closed."""
        if len(self._queue) >= self.capacity:
            raise MailboxFull(f"mailbox full ({self.capacity} messages queued)")
        self.put_internal(msg)

    def put_internal(self, msg: M) -> None:
        """Acks and internal messages: never blocks, ignores the capacity."""
        if self._closed:
            raise RuntimeClosed("mailbox closed")
        self._queue.append(msg)
        self._wake()

    def take_burst(self) -> list[M]:
        """Everything queued, oldest first ([] when nothing is)."""
        queue = self._queue
        if not queue:
            return []
        burst = list(queue)
        queue.clear()
        return burst

    def ready(self) -> asyncio.Future[None] | None:
        """A future done once a message is queued or the mailbox closes; None when one already
        is, or it is closed (the receiver then takes a burst, or stops on an empty one)."""
        if self._queue or self._closed:
            return None
        waiter = self._waiter
        if waiter is None or waiter.done():
            waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter

    async def get_burst(self) -> list[M]:
        """Wait for at least one message, then drain everything queued (one wake-up per burst).
        Returns [] once the mailbox is closed and empty, or aborted (the runtime failed: the
        other actors stop quietly, the failure is the first actor's)."""
        while True:
            waiter = self.ready()
            if waiter is None:
                return self.take_burst()
            await waiter

    def close(self) -> None:
        """No more sends; the receiver drains what is queued, then sees the end."""
        if not self._closed:
            self._closed = True
            self._wake()

    def abort(self) -> list[M]:
        """Close and return what was still queued (used when the runtime fails)."""
        self.close()
        return self.take_burst()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


Handler = Callable[[Any], Any]


class _Deferred:
    """A handler's return value meaning: "I keep the reply and complete it later myself"."""

    __repr__ = lambda self: "DEFERRED"  # noqa: E731


DEFERRED: Any = _Deferred()


class Actor(Generic[M]):
    """Base of the three actors: a loop over mailbox bursts dispatching by message type.

    Subclasses fill `handlers` (message type -> bound method) and may override `after_message`
    (the tree actor hands on the core's effects, runs the debug invariant checker) and
    `after_burst` (the transfer actor starts the copies a burst queued), and `started` /
    `stopping` (what the actor's task sets up and tears down: the transfer actor's bridge).
    Handlers run to completion one at a time; an async handler is awaited before the next
    message.
    """

    name = "actor"

    def __init__(self, mailbox_capacity: int, mailbox: Mailbox[M] | None = None, phase: Phase | None = None) -> None:
        # `mailbox`: made beforehand when two actors must know each other's (tree <-> offload)
        self.mailbox: Mailbox[M] = mailbox if mailbox is not None else Mailbox(mailbox_capacity)
        # `phase`: the one the handlers' state marks (the tree actor's core); a handler that never
        # marks it has only checks, as far as its errors go
        self.phase = phase if phase is not None else Phase()
        self.handlers: dict[type, Handler] = {}
        self.messages_handled = 0

    async def run(self, on_failure: Callable[[BaseException, str], None] | None = None) -> None:
        """The actor's task: `started`, bursts until the mailbox closes, then `stopping`. A failure
        (anything but a cancellation) is handed to `on_failure` (the supervisor's) as it leaves.
        One coroutine frame from the task down to the wait: a wake-up resumes only this one."""
        mailbox = self.mailbox
        # the per-message hook runs only where an actor has one (a call fewer per message elsewhere)
        after_message = self.after_message if type(self).after_message is not Actor.after_message else None
        try:
            self.started()
            try:
                while True:
                    burst = mailbox.take_burst()
                    if not burst:
                        waiter = mailbox.ready()
                        if waiter is None:
                            return  # closed and drained (or aborted)
                        await waiter
                        continue
                    for msg in burst:
                        self.messages_handled += 1
                        result = self._handle(msg)
                        if type(result) is _Coroutine:
                            result = await result
                        reply = msg.reply
                        if reply is not None and result is not DEFERRED:
                            reply.set_result(result)
                        if after_message is not None:
                            after_message(msg)
                    self.after_burst()
            finally:
                await self.stopping()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            if on_failure is not None:
                on_failure(exc, self.name)
            raise

    def _handle(self, msg: Any) -> Any:
        """One message's result (a coroutine of an async handler; DEFERRED when the reply was
        set here, a refusal included); a batch's is its items' results in order."""
        phase = self.phase
        if type(msg) is Batch:
            return self._handle_batch(msg)
        if phase.changing:  # (a handler that changed nothing left it checking)
            phase.begin()
        try:
            result = self.handlers[type(msg)](msg)
        except CallerError as exc:
            if msg.reply is None or phase.internal(exc):
                raise self._unrefusable(exc, msg)
            msg.reply.set_exception(exc)
            return DEFERRED
        if type(result) is _Coroutine or asyncio.iscoroutine(result):
            return self._awaited(result, msg)
        return result

    async def _awaited(self, coro: Any, msg: Any) -> Any:
        try:
            return await coro
        except CallerError as exc:
            if msg.reply is None or self.phase.internal(exc):
                raise self._unrefusable(exc, msg)
            msg.reply.set_exception(exc)
            return DEFERRED

    async def _handle_batch(self, msg: Batch) -> tuple[Any, ...]:
        """A whole scheduling step, its items inline (no coroutine per item); an item's refusal is
        its result."""
        phase = self.phase
        handlers = self.handlers
        out = []
        for item in msg.items:
            phase.begin()
            try:
                r = handlers[type(item)](item)
                if type(r) is _Coroutine:
                    r = await r
            except CallerError as exc:
                if phase.internal(exc):
                    raise self._unrefusable(exc, item)
                r = exc
            out.append(r)
        return tuple(out)

    def started(self) -> None:
        """Hook run once as the actor's task starts, before the first message."""

    async def stopping(self) -> None:
        """Hook run once as the actor's task ends (mailbox closed, a failure, a cancellation)."""

    def _unrefusable(self, exc: CallerError, msg: Any) -> CallerError:
        """`exc` fails the runtime as it is (the supervisor's cause); the note says why it was not
        handed to a caller."""
        why = "raised after the handler's checks passed" if self.phase.internal(exc) else "no caller to take it"
        exc.add_note(f"{self.name} actor, handling {type(msg).__name__}: {why}; the runtime fails")
        return exc

    def after_burst(self) -> None:
        """Hook run once the burst's messages are handled, before the actor waits again."""

    def after_message(self, msg: Any) -> None:
        """Hook run after each handled message (debug invariant checks)."""
