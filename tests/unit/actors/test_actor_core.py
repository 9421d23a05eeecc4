"""Actor core: ask/tell, batches, validation errors, fail-whole, cancellation, close, back-pressure.

The fail-whole tests say how they failed before the fix."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from typing import Any

from runtime import supervisor as supervisor_module
from runtime.actors.base import Actor, Mailbox, Reply
from runtime.messages import Batch
from runtime.errors import (
    CapacityError,
    LengthError,
    MailboxFull,
    OwnershipError,
    PinnedSlotError,
    RuntimeClosed,
    RuntimeFailed,
    StateError,
    TransferError,
    ValidationError,
)
from runtime.supervisor import State, Supervisor
from runtime.tree.radix import TreeError


@dataclass(frozen=True, slots=True)
class Add:
    n: int
    reply: Reply[int] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Boom:
    reply: Reply[None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Raise:
    """The handler raises `error` (built fresh per message)."""

    error: Any
    reply: Reply[None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class ChangeThenRaise:
    """The handler passes its checks, adds `n` (a change), then raises `error`; with `undo` it takes
    the change back and refuses through `phase.refuse`."""

    n: int
    error: Any
    undo: bool = False
    reply: Reply[None] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Slow:
    delay: float
    reply: Reply[str] | None = field(default=None, compare=False)


class Counter(Actor):
    name = "counter"

    def __init__(self, capacity: int = 64) -> None:
        super().__init__(capacity)
        self.total = 0
        self.bursts: list[int] = []
        self.handlers = {Add: self.on_add, Boom: self.on_boom, Slow: self.on_slow, Raise: self.on_raise,
                         ChangeThenRaise: self.on_change_then_raise}

    def on_add(self, msg: Add) -> int:
        if msg.n < 0:
            raise ValidationError("negative")
        self.total += msg.n
        return self.total

    def on_boom(self, msg: Boom) -> None:
        raise RuntimeError("handler bug")

    def on_raise(self, msg: Raise) -> None:
        raise msg.error()

    def on_change_then_raise(self, msg: ChangeThenRaise) -> None:
        self.phase.change()
        self.total += msg.n
        if msg.undo:
            self.total -= msg.n
            raise self.phase.refuse(msg.error())
        raise msg.error()

    async def on_slow(self, msg: Slow) -> str:
        await asyncio.sleep(msg.delay)
        return "slow-done"


async def started(actor: Counter) -> Supervisor:
    sup = Supervisor([actor])
    await sup.start()
    return sup


async def test_ask_and_tell_round_trip():
    actor = Counter()
    sup = await started(actor)
    assert await sup.ask(actor.mailbox, Add(2, Reply())) == 2
    sup.tell(actor.mailbox, Add(3))
    assert await sup.ask(actor.mailbox, Add(0, Reply())) == 5
    await sup.stop()
    assert sup.state is State.CLOSED


async def test_validation_error_goes_to_caller_and_actor_lives_on():
    actor = Counter()
    sup = await started(actor)
    with pytest.raises(ValidationError, match="negative"):
        await sup.ask(actor.mailbox, Add(-1, Reply()))
    assert actor.total == 0
    assert await sup.ask(actor.mailbox, Add(4, Reply())) == 4
    await sup.stop()


async def test_batch_reports_per_item_and_failed_item_changes_nothing():
    actor = Counter()
    sup = await started(actor)
    results = await sup.ask_batch(actor.mailbox, [Add(1), Add(-5), Add(2)])
    assert results[0] == 1 and results[2] == 3
    assert isinstance(results[1], ValidationError)
    assert actor.total == 3
    await sup.stop()


async def test_handler_crash_fails_runtime_and_every_pending_call():
    actor = Counter()
    sup = await started(actor)
    slow = asyncio.ensure_future(sup.ask(actor.mailbox, Slow(0.05, Reply())))
    await asyncio.sleep(0)
    queued = asyncio.ensure_future(sup.ask(actor.mailbox, Add(1, Reply())))
    with pytest.raises(RuntimeFailed) as info:
        await sup.ask(actor.mailbox, Boom(Reply()))
    assert isinstance(info.value.__cause__, RuntimeError)
    # the slow call was running when the crash came after it; the queued one never ran
    for fut in (queued,):
        with pytest.raises(RuntimeFailed):
            await fut
    await slow  # it completed before the crash was handled (handlers run one at a time)
    with pytest.raises(RuntimeFailed):
        await sup.ask(actor.mailbox, Add(1, Reply()))
    await sup.wait_stopped()
    assert sup.state is State.FAILED


async def test_crash_does_not_cancel_embedder_tasks():
    actor = Counter()
    sup = await started(actor)
    ticks = 0

    async def embedder_task():
        nonlocal ticks
        for _ in range(5):
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.ensure_future(embedder_task())
    with pytest.raises(RuntimeFailed):
        await sup.ask(actor.mailbox, Boom(Reply()))
    await task
    assert ticks == 5 and not task.cancelled()


async def test_cancelled_caller_message_still_handled_and_abandon_hook_runs():
    actor = Counter()
    sup = await started(actor)
    abandoned: list[int] = []
    reply: Reply[int] = Reply(on_abandon=abandoned.append)
    call = asyncio.ensure_future(sup.ask(actor.mailbox, Add(7, reply)))
    await asyncio.sleep(0)  # message is in the mailbox
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await sup.ask(actor.mailbox, Add(0, Reply())) == 7  # the cancelled Add was applied
    assert abandoned == [7]  # and the façade hook got what it produced, once
    await sup.stop()


async def test_abandon_when_value_arrived_but_caller_cancelled_before_resuming():
    loop = asyncio.get_running_loop()
    abandoned: list[str] = []
    reply: Reply[str] = Reply(loop, on_abandon=abandoned.append)

    async def caller():
        return await reply.wait()

    task = asyncio.ensure_future(caller())
    await asyncio.sleep(0)
    reply.set_result("slots")
    task.cancel()  # value delivered, caller not resumed yet
    with pytest.raises(asyncio.CancelledError):
        await task
    assert abandoned == ["slots"]


async def test_mailbox_full_is_explicit_backpressure():
    box: Mailbox[int] = Mailbox(2)
    box.put_nowait(1)
    box.put_nowait(2)
    with pytest.raises(MailboxFull):
        box.put_nowait(3)
    box.put_internal(99)  # acks are never refused
    assert await box.get_burst() == [1, 2, 99]  # one wake-up drains the whole burst
    box.put_nowait(4)  # room again
    assert await box.get_burst() == [4]


async def test_close_drains_queued_messages_then_calls_raise_closed():
    actor = Counter()
    sup = await started(actor)
    for _ in range(10):
        sup.tell(actor.mailbox, Add(1))
    sup.state = State.CLOSING
    with pytest.raises(RuntimeClosed):
        await sup.ask(actor.mailbox, Add(1, Reply()))
    await sup.stop()
    assert actor.total == 10
    with pytest.raises(RuntimeClosed):
        sup.tell(actor.mailbox, Add(1))


async def test_burst_is_drained_in_one_wakeup():
    actor = Counter()
    sup = await started(actor)
    for _ in range(50):
        sup.tell(actor.mailbox, Add(1))
    assert actor.messages_handled == 0
    await sup.ask(actor.mailbox, Add(0, Reply()))
    assert actor.total == 50
    await sup.stop()


class LogRecorder:
    """Stands in for the supervisor's structlog logger: the events it was given, by level."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((level, event, kw))


async def test_a_caller_error_of_a_message_without_reply_fails_the_runtime():
    """Nobody can be told of a refused one-way message (an ack): the runtime fails with it as the
    cause. Before the fix the ValidationError was dropped and the next call returned 1."""
    actor = Counter()
    sup = await started(actor)
    sup.tell(actor.mailbox, Add(-1))
    with pytest.raises(RuntimeFailed) as info:
        await sup.ask(actor.mailbox, Add(1, Reply()))
    assert isinstance(info.value.__cause__, ValidationError)
    assert any("no caller to take it" in note for note in info.value.__cause__.__notes__)
    await sup.wait_stopped()
    assert sup.state is State.FAILED


INTERNAL = [lambda: TreeError("tree"), lambda: OwnershipError("ledger"), lambda: PinnedSlotError("pinned")]


@pytest.mark.parametrize("batched", [False, True], ids=["ask", "batch"])
@pytest.mark.parametrize("make", INTERNAL, ids=["TreeError", "OwnershipError", "PinnedSlotError"])
async def test_internal_structures_errors_fail_the_runtime_even_for_a_call_with_a_reply(make, batched):
    """TreeError, OwnershipError and PinnedSlotError are the errors of the tree and the ledgers,
    which only the actors call (InternalErrors): raised inside a handler, even in its check phase,
    they fail the runtime, for an ask and for a batch item alike. Before the fix (when they were
    ValidationErrors) they went back to the caller (raised by the ask, or in the batch's tuple)
    and the actor went on."""
    actor = Counter()
    sup = await started(actor)
    with pytest.raises(RuntimeFailed) as info:
        if batched:
            await sup.ask_batch(actor.mailbox, [Add(1), Raise(make), Add(2)])
        else:
            await sup.ask(actor.mailbox, Raise(make, Reply()))
    assert type(info.value.__cause__) is type(make())
    assert actor.total == (1 if batched else 0)  # the batch stopped at the failing item
    with pytest.raises(RuntimeFailed):
        await sup.ask(actor.mailbox, Add(1, Reply()))
    await sup.wait_stopped()


@pytest.mark.parametrize("batched", [False, True], ids=["ask", "batch"])
@pytest.mark.parametrize("error", [StateError, CapacityError, LengthError])
async def test_a_validation_error_after_the_first_change_fails_the_runtime(error, batched):
    """Errors by origin: a ValidationError raised after the handler marked its first change
    (`phase.change()`) claims that nothing changed when something did: the runtime fails with it
    as the cause, for an ask and for a batch item alike, whatever its type. Checked against the
    rule by type (`Phase.internal` returning False): the caller got the error and the actor went on
    with the change made (`total` 5)."""
    actor = Counter()
    sup = await started(actor)
    with pytest.raises(RuntimeFailed) as info:
        if batched:
            await sup.ask_batch(actor.mailbox, [Add(1), ChangeThenRaise(5, error), Add(2)])
        else:
            await sup.ask(actor.mailbox, ChangeThenRaise(5, error, reply=Reply()))
    assert type(info.value.__cause__) is error
    assert any("after the handler's checks passed" in note for note in info.value.__cause__.__notes__)
    await sup.wait_stopped()


async def test_a_refusal_after_an_undone_change_and_a_transfer_error_go_to_the_caller():
    """`phase.refuse(exc)`: the handler took its change back, so the refusal is the caller's; a
    TransferError after a change is the call's outcome, not a refusal: it goes back too. The next
    message starts in its check phase again."""
    actor = Counter()
    sup = await started(actor)
    with pytest.raises(CapacityError):
        await sup.ask(actor.mailbox, ChangeThenRaise(5, CapacityError, undo=True, reply=Reply()))
    with pytest.raises(TransferError):
        await sup.ask(actor.mailbox, ChangeThenRaise(5, TransferError, reply=Reply()))
    with pytest.raises(ValidationError):
        await sup.ask(actor.mailbox, Add(-1, Reply()))  # (checks only: a refusal)
    assert await sup.ask(actor.mailbox, Add(1, Reply())) == 6
    out = await sup.ask_batch(actor.mailbox, [ChangeThenRaise(1, CapacityError, undo=True), Add(-1), Add(1)])
    assert isinstance(out[0], CapacityError) and isinstance(out[1], ValidationError) and out[2] == 7
    await sup.stop()
    assert sup.state is State.CLOSED


async def test_a_caller_error_with_a_reply_still_goes_to_its_caller():
    """The boundary's other side: a CallerError that is not an internal structure's, for a call
    with a reply, is that caller's alone (here a StateError)."""
    actor = Counter()
    sup = await started(actor)
    with pytest.raises(StateError):
        await sup.ask(actor.mailbox, Raise(lambda: StateError("busy"), Reply()))
    assert await sup.ask(actor.mailbox, Add(3, Reply())) == 3
    await sup.stop()
    assert sup.state is State.CLOSED


async def test_a_failure_is_logged_once_with_its_cause(monkeypatch):
    """One crash, one `actor_failed` error event naming the actor and the cause; the other actors
    stop quietly. Before the fix the idle second actor met its aborted mailbox (ClosedResourceError)
    and a second `actor_failed` error was logged."""
    recorder = LogRecorder()
    monkeypatch.setattr(supervisor_module, "log", recorder)
    crashing, idle = Counter(), Counter()
    idle.name = "idle"
    sup = Supervisor([crashing, idle])
    await sup.start()
    await asyncio.sleep(0)  # both wait on their mailboxes
    with pytest.raises(RuntimeFailed):
        await sup.ask(crashing.mailbox, Boom(Reply()))
    await sup.wait_stopped()
    errors = [(event, kw) for level, event, kw in recorder.events if level == "error"]
    assert errors == [("actor_failed", {"actor": "counter", "error": repr(RuntimeError("handler bug"))})]
    assert recorder.events == [("error", *errors[0])]
