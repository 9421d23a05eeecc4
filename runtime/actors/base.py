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

The mailbox is an anyio memory object stream. Its buffer is unbounded underneath so that
acks and internal messages never block their sender (no cycle of blocking sends); the
bound applies to external sends: `put_nowait` raises `MailboxFull` (explicit
back-pressure, never a silent drop).
"""

from __future__ import annotations

import asyncio
import math
import types
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

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
    """A private mailbox: unbounded anyio stream, soft capacity for external senders."""

    __slots__ = ("capacity", "_send", "_recv", "_queued", "_closed")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._send: MemoryObjectSendStream[M]
        self._recv: MemoryObjectReceiveStream[M]
        self._send, self._recv = anyio.create_memory_object_stream[M](math.inf)
        self._queued = 0
        self._closed = False

    @property
    def depth(self) -> int:
        return self._queued

    @property
    def closed(self) -> bool:
        return self._closed

    def put_nowait(self, msg: M) -> None:
        """External send: raises `MailboxFull` at capacity, `RuntimeClosed` once closed."""
        if self._queued >= self.capacity:
            raise MailboxFull(f"mailbox full ({self.capacity} messages queued)")
        self.put_internal(msg)

    def put_internal(self, msg: M) -> None:
        """Acks and internal messages: never blocks, ignores the capacity."""
        if self._closed:
            raise RuntimeClosed("mailbox closed")
        self._send.send_nowait(msg)
        self._queued += 1

    async def get_burst(self) -> list[M]:
        """Wait for at least one message, then drain everything queued (one wake-up per burst).
        Returns [] once the mailbox is closed and empty, or aborted (the runtime failed: the
        other actors stop quietly, the failure is the first actor's)."""
        burst: list[M] = []
        try:
            while True:
                burst.append(self._recv.receive_nowait())
        except anyio.WouldBlock:
            pass
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            pass
        if not burst:
            try:
                burst.append(await self._recv.receive())
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return []
            try:
                while True:
                    burst.append(self._recv.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                pass
        self._queued -= len(burst)
        return burst

    def close(self) -> None:
        """No more sends; the receiver drains what is queued, then sees the end."""
        if not self._closed:
            self._closed = True
            self._send.close()

    def abort(self) -> list[M]:
        """Close both ends and return what was still queued (used when the runtime fails)."""
        self.close()
        left: list[M] = []
        try:
            while True:
                left.append(self._recv.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            pass
        self._recv.close()
        self._queued = 0
        return left


Handler = Callable[[Any], Any]


class _Deferred:
    """A handler's return value meaning: "I keep the reply and complete it later myself"."""

    __repr__ = lambda self: "DEFERRED"  # noqa: E731


DEFERRED: Any = _Deferred()


class Actor(Generic[M]):
    """Base of the three actors: a loop over mailbox bursts dispatching by message type.

    Subclasses fill `handlers` (message type -> bound method) and may override `after_message`
    (the tree actor hands on the core's effects, runs the debug invariant checker) and
    `after_burst` (the transfer actor starts the copies a burst queued). Handlers run to
    completion one at a time; an async handler is awaited before the next message.
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

    async def run(self) -> None:
        phase = self.phase
        while True:
            burst = await self.mailbox.get_burst()
            if not burst:
                return
            for msg in burst:
                self.messages_handled += 1
                reply = msg.reply
                if type(msg) is Batch:
                    # inline (no coroutine per item): a batch is a whole scheduling step
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
                    result: Any = tuple(out)
                else:
                    phase.begin()
                    try:
                        result = self.handlers[type(msg)](msg)
                        if type(result) is _Coroutine or asyncio.iscoroutine(result):
                            result = await result
                    except CallerError as exc:
                        if reply is None or phase.internal(exc):
                            raise self._unrefusable(exc, msg)
                        reply.set_exception(exc)
                        self.after_message(msg)
                        continue
                if reply is not None and result is not DEFERRED:
                    reply.set_result(result)
                self.after_message(msg)
            self.after_burst()

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
