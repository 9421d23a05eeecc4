"""Runs the actors in one anyio task group inside the embedder's loop and fails them as a whole.

The task group lives in a task of its own, so an actor crash never cancels the embedder's
tasks (the body of `async with CacheRuntime.open(...)` included): pending and later calls
raise `RuntimeFailed`, and leaving the `async with` re-raises it. A failure is logged once, as
one `actor_failed` error event with its cause.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Sequence
from typing import Any, TypeVar

import anyio

from runtime.actors.base import Actor, Mailbox, Reply
from runtime.messages import Batch
from runtime.errors import ForeignLoopError, RuntimeClosed, RuntimeFailed
from runtime.trace import get_logger

T = TypeVar("T")
log = get_logger("hicache.runtime")


class State(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


async def wait_shielded(task: asyncio.Future[Any], timeout: float) -> bool:
    """Wait up to `timeout` s for `task`, whatever cancels the waiter meanwhile; True if it is done.

    For cleanup that must outlive its caller's cancellation (the caller re-raises its own
    cancellation afterwards): the shielded scope keeps an anyio scope from cancelling the wait
    again and again, and a plain asyncio cancel is absorbed; the bound keeps a hung task from
    holding a cancelled caller forever."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    with anyio.CancelScope(shield=True):
        while not task.done():
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait((task,), timeout=left)
            except asyncio.CancelledError:
                continue  # the caller is cancelled again: the bound still holds
    return True


class Supervisor:
    def __init__(self, actors: Sequence[Actor[Any]]) -> None:
        self.actors = list(actors)
        self.state = State.OPEN
        self.failure: BaseException | None = None
        self._pending: set[Reply[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop the actors run in (set by start)

    # -- lifecycle ---------------------------------------------------------------
    @property
    def started(self) -> bool:
        """Whether the actors' task exists (they run, or ran): only then can anything answer."""
        return self._task is not None

    async def start(self) -> None:
        """Start the actors' task. A caller cancelled here must still stop it (`CacheRuntime.open`
        closes in a `finally`): the task exists from the first step on."""
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="hicache-supervisor")
        await self._started.wait()

    async def _run(self) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for actor in self.actors:
                    tg.start_soon(actor.run, self._actor_failed, name=f"hicache-{actor.name}")
                self._started.set()
        except BaseException as exc:  # noqa: BLE001 - the failure is recorded and re-raised at exit
            if self.failure is None:
                self._fail(exc, actor="supervisor")
        finally:
            self._started.set()

    def _actor_failed(self, exc: BaseException, name: str) -> None:
        """An actor's task is failing with `exc` (`Actor.run` calls this as it leaves)."""
        self._fail(exc, actor=name)

    def _fail(self, exc: BaseException, *, actor: str | None = None, event: str = "actor_failed") -> None:
        if self.failure is not None:
            # e.g. another actor stopping badly once the runtime failed: an echo, not a second failure
            log.warning(f"{event}_after_failure", actor=actor, error=repr(exc))
            return
        log.error(event, actor=actor, error=repr(exc))
        self.failure = exc
        self.state = State.FAILED
        error = RuntimeFailed(exc)
        for actor_ in self.actors:
            for msg in actor_.mailbox.abort():
                if msg.reply is not None:
                    msg.reply.set_exception(error)
        for reply in list(self._pending):
            reply.set_exception(error)
        self._pending.clear()

    async def stop(self) -> None:
        """Close every mailbox in order (each actor drains what is queued) and wait for the group."""
        for actor in self.actors:
            actor.mailbox.close()
        if self._task is not None:
            await asyncio.shield(self._task)
        if self.state is not State.FAILED:
            self.state = State.CLOSED

    async def terminate(self, cause: BaseException, *, timeout: float = 2.0) -> None:
        """Stop now without waiting for anything in flight (a cancelled close that ran out of its
        grace): the runtime fails with `cause` (one `runtime_terminated` error event), and the
        actors' task group is cancelled. Waits for it at most `timeout` s."""
        self._fail(cause, event="runtime_terminated")
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            if not await wait_shielded(task, timeout):
                log.error("runtime_terminate_stuck", timeout_s=timeout)

    async def wait_stopped(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeFailed(self.failure)

    # -- calls -----------------------------------------------------------------
    def check_loop(self) -> None:
        """`ForeignLoopError` unless called in the actors' loop (its thread, while it runs)."""
        if self.loop is None:
            return
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:  # a thread with no running loop
            current = None
        if current is not self.loop:
            raise ForeignLoopError("the runtime was opened in another event loop (or thread): call it from that loop, "
                                   "e.g. asyncio.run_coroutine_threadsafe(coro, loop) from another thread")

    def check_open(self) -> None:
        self.check_loop()
        if self.state is State.OPEN:
            return
        if self.state is State.FAILED:
            raise RuntimeFailed(self.failure)
        raise RuntimeClosed(f"runtime is {self.state.value}")

    async def ask(self, mailbox: Mailbox[Any], msg: Any) -> Any:
        """Send `msg` (which carries a `Reply`) and await the reply."""
        self.check_open()
        return await self.ask_internal(mailbox, msg)

    async def ask_internal(self, mailbox: Mailbox[Any], msg: Any) -> Any:
        """As `ask`, also while closing (the façade's own shutdown messages)."""
        self.check_loop()
        if self.failure is not None:
            raise RuntimeFailed(self.failure)
        reply: Reply[Any] = msg.reply
        mailbox.put_nowait(msg)
        pending = self._pending
        pending.add(reply)
        try:
            return await reply.wait()
        finally:
            pending.discard(reply)

    async def ask_batch(self, mailbox: Mailbox[Any], items: Sequence[Any]) -> tuple[Any, ...]:
        return await self.ask(mailbox, Batch(tuple(items), Reply()))

    def tell(self, mailbox: Mailbox[Any], msg: Any) -> None:
        self.check_open()
        mailbox.put_nowait(msg)
