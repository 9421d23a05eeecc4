"""The caller contract at the façade and the actor boundary.

A `ValidationError` means nothing changed and goes to its caller alone; anything else fails the
runtime whole. One regression per behaviour; each docstring says how it failed before the fix (the
test run against the runtime before it).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from runtime import errors
from runtime.actors.base import Reply
from runtime.errors import LengthError, RuntimeFailed, StateError, ValidationError
from runtime.messages import Abort, Admit, Cache, Commit, Direction, Extend, Finish, ReleaseAbandoned, TransferAck
from runtime.runtime import CacheRuntime
from runtime.transfer.fake_engine import FakeCopyEngine
from runtime.tree.radix import TreeError
from tests.integration.support import compute, quiescent_check, small_config, toks, until

ROOT = Path(__file__).resolve().parents[2]


async def serve(rt: CacheRuntime, rid: Any, tokens: np.ndarray, extra_key: Any = None) -> None:
    res = await rt.admit(rid, tokens, extra_key)
    compute(rt, res.slots, tokens, extra_key, start=res.cached)
    await rt.finish(rid, tokens)


def hicache_tasks() -> list[str]:
    return sorted(t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("hicache-") and not t.done())


async def still_serves(rt: CacheRuntime) -> None:
    """The runtime did not fail: a request goes through and the state is sound."""
    assert not rt.failed
    await serve(rt, "after", toks(9, 99))
    await quiescent_check(rt)


class HashRaises:
    def __hash__(self) -> int:
        raise TypeError("no hash for you")


class EqRaises:
    """Hashes like None, so a dict holding None (the default namespace's root) compares with it."""

    def __hash__(self) -> int:
        return hash(None)

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no equality for you")


# -- caller values that crashed everyone ---------------------------------------------------------

BAD_ID_CALLS = {
    "admit rid list": lambda rt, t: rt.admit([1], t),
    "admit rid dict": lambda rt, t: rt.admit({"a": 1}, t),
    "admit rid hash raises": lambda rt, t: rt.admit(HashRaises(), t),
    "admit rid bool": lambda rt, t: rt.admit(True, t),
    "admit rid float": lambda rt, t: rt.admit(1.0, t),
    "admit rid numpy int": lambda rt, t: rt.admit(np.int64(1), t),
    "admit rid object": lambda rt, t: rt.admit(object(), t),
    "admit extra_key list": lambda rt, t: rt.admit("x", t, [1]),
    "admit extra_key eq raises": lambda rt, t: rt.admit("x", t, EqRaises()),
    "admit session list": lambda rt, t: rt.admit("x", t, session=[1]),
    "match_prefix extra_key dict": lambda rt, t: rt.match_prefix(t, {}),
    "can_admit extra_key set": lambda rt, t: rt.can_admit(t, {1}),
    "prepare rid list": lambda rt, t: rt.prepare([1], t),
    "open_session sid list": lambda rt, t: rt.open_session([1]),
    "open_session extra_key float": lambda rt, t: rt.open_session("s2", 2.5),
    "close_session insert not bool": lambda rt, t: rt.close_session("s", insert="yes"),
    "abort rid list": lambda rt, t: rt.abort([1]),
}


@pytest.mark.parametrize("call", BAD_ID_CALLS.values(), ids=BAD_ID_CALLS.keys())
async def test_ids_and_namespaces_that_are_not_plain_keys_are_refused_to_their_caller(call):
    """An unhashable id, one whose hash or equality raises, or one that equals
    another-looking id (True == 1 == 1.0 == np.int64(1)) is an ArgumentError for that caller;
    the runtime serves on. Before the fix the unhashable and raising ones failed the whole runtime
    (TypeError/RuntimeError in the tree actor) and the others were accepted."""
    async with CacheRuntime.open(small_config()) as rt:
        await serve(rt, "warm", toks(13, 1))  # the default namespace's root exists
        await rt.open_session("s")
        before = await rt.stats()
        with pytest.raises(ValidationError) as info:
            await call(rt, toks(10, 2))
        assert isinstance(info.value, errors.ArgumentError)
        after = await rt.stats()
        assert after["requests"]["live"] == before["requests"]["live"] and after["tree"]["nodes"] == before["tree"]["nodes"]
        await rt.close_session("s")
        await still_serves(rt)


async def test_plain_keys_are_accepted_as_ids_and_namespaces():
    """The accepted forms all work end to end (str, bytes, int, uuid.UUID and nested tuples as
    ids; None, str, bytes, int and tuples with None as namespaces)."""
    async with CacheRuntime.open(small_config()) as rt:
        prompt = toks(13, 3)
        for i, (rid, ns) in enumerate([("r", None), (b"r", "t"), (7, b"t"), (uuid.uuid4(), 7),
                                       (("r", (1, b"x")), ("t", (None, 2)))]):
            await serve(rt, rid, prompt, ns)
            assert await rt.match_prefix(prompt, ns) == {"device": 12, "host": 0}, (i, rid, ns)
        await rt.open_session((1, "s"), ("tenant", 1))
        assert await rt.close_session((1, "s"), insert=False) == 0
        await quiescent_check(rt)


@pytest.mark.parametrize("alias", [1.0, True, np.int64(1)], ids=["float", "bool", "numpy"])
async def test_python_equal_namespaces_are_never_confused(alias):
    """Of the Python-equal namespaces 1, 1.0, True and np.int64(1) only the int is
    accepted, so a prompt cached under one is never served under another. Before the fix all four
    shared one root: the prompt cached under 1 matched 12 tokens under the alias."""
    async with CacheRuntime.open(small_config()) as rt:
        prompt = toks(13, 4)
        await serve(rt, "a", prompt, 1)
        with pytest.raises(ValidationError) as info:
            await rt.match_prefix(prompt, alias)
        assert isinstance(info.value, errors.ArgumentError)
        with pytest.raises(errors.ArgumentError):
            await rt.admit("b", prompt, alias)
        assert await rt.match_prefix(prompt, 1) == {"device": 12, "host": 0}
        await still_serves(rt)


async def test_step_refuses_what_is_not_a_public_request_item_by_item():
    """`step` takes only Admit, Extend, Commit, Cache, Finish and Abort built with
    reply=None, fields checked as for the single calls; a bad item gets its ValidationError in its
    place and is never sent, the others run. Before the fix the "x" item failed the whole runtime
    (RuntimeFailed: KeyError in the tree actor)."""
    async with CacheRuntime.open(small_config()) as rt:
        t = toks(10, 5)
        res = await rt.admit("live", t)
        items = [Admit("a", t), "x", TransferAck(1, Direction.BACKUP), ReleaseAbandoned("live", res.generation),
                 Admit("b", t, reply=Reply()), Extend([1], 2), Admit("c", t.astype(np.float64)), Extend("a", 4),
                 Commit("a", True), Finish("a", t, finished_len=1.0)]
        out = await rt.step(items)
        assert len(out) == len(items)
        assert out[0].rid == "a" and isinstance(out[7], torch.Tensor) and len(out[7]) == 4
        for i in (1, 2, 3, 4, 5, 6, 8, 9):
            assert isinstance(out[i], ValidationError), (i, out[i])
        assert isinstance(out[1], errors.ArgumentError) and isinstance(out[6], errors.TokenError)
        assert isinstance(out[8], LengthError) and isinstance(out[9], LengthError)
        assert (await rt.stats())["requests"]["live"] == 2  # "live" was not released by the smuggled item
        [only] = await rt.step(["x"])  # nothing valid: nothing is sent, the refusal comes back
        assert isinstance(only, errors.ArgumentError)
        with pytest.raises(errors.ArgumentError):
            await rt.step(Admit("d", t))  # not a list of items
        await rt.abort("a")
        await rt.abort("live")
        await still_serves(rt)


async def test_counts_are_exact_ints():
    """Counts are exact ints (a bool is not a count). Before the fix `extend(rid, True)` extended
    the request by one token."""
    async with CacheRuntime.open(small_config()) as rt:
        t = toks(10, 6)
        await rt.admit("a", t)
        for call in (lambda: rt.extend("a", True), lambda: rt.commit("a", 10.0), lambda: rt.rewind("a", np.int64(10)),
                     lambda: rt.finish("a", t, finished_len=True)):
            with pytest.raises(LengthError):
                await call()
        assert len(await rt.extend("a", 2)) == 2
        await rt.abort("a")
        await still_serves(rt)


# -- token ids silently coerced -----------------------------------------------------------------

BAD_TOKENS = {
    "int64 >= 2**31": (np.array([2**32 + 5, 7, 9], dtype=np.int64), "TokenError"),
    "torch int64 >= 2**31": (torch.tensor([2**31, 7, 9]), "TokenError"),
    "negative": (np.array([3, -1, 9], dtype=np.int32), "TokenError"),
    "floats": (np.array([1.5, 2.0, 3.0]), "TokenError"),
    "nan": (np.array([1.0, np.nan]), "TokenError"),
    "torch floats": (torch.tensor([1.0, 2.0]), "TokenError"),
    "bools": ([True, False, True], "TokenError"),
    "digit strings": (["1", "2"], "TokenError"),
    "object array": (np.array([1, "2"], dtype=object), "TokenError"),
    "a string": ("1234", "TokenError"),
    "a dict": ({1: 2}, "TokenError"),
    "int and bool": ([5, True], "TokenError"),
    "empty": ([], "LengthError"),
    "2-D": (np.zeros((2, 4), dtype=np.int32), "LengthError"),
}


@pytest.mark.parametrize("bad,kind", BAD_TOKENS.values(), ids=BAD_TOKENS.keys())
async def test_token_ids_are_checked_in_the_callers_coroutine_and_never_coerced(bad, kind):
    """Token ids are integers in [0, 2**31) in a non-empty 1-D array, tensor or
    list; anything else is a ValidationError raised before any message is sent (TokenError for
    values, LengthError for shape), in every call that takes tokens. Before the fix most were wrapped,
    truncated or parsed and taken, "1234" and a dict gave a LengthError and a bare TypeError, and
    empty or 2-D input was refused only inside the tree actor."""
    async with CacheRuntime.open(small_config()) as rt:
        sent: list[Any] = []
        ask = rt._sup.ask

        async def spy(mailbox: Any, msg: Any, **kw: Any) -> Any:
            sent.append(msg)
            return await ask(mailbox, msg, **kw)

        rt._sup.ask = spy  # type: ignore[method-assign]
        calls = [lambda: rt.admit("a", bad), lambda: rt.match_prefix(bad), lambda: rt.can_admit(bad),
                 lambda: rt.cache("a", bad), lambda: rt.finish("a", bad)]
        if kind == "TokenError":
            calls.append(lambda: rt.prepare("a", bad))  # a bad length is 0 from prepare (documented)
        for call in calls:
            with pytest.raises(ValidationError) as info:
                await call()
            assert type(info.value).__name__ == kind
        out = await rt.step([Admit("a", bad), Cache("a", bad), Finish("a", bad)])
        assert [type(r).__name__ for r in out] == [kind] * 3
        assert sent == []
        del rt._sup.ask
        await still_serves(rt)


async def test_an_int64_prompt_never_matches_another_prompt_by_wrapping():
    """A never-seen int64 prompt whose ids are another prompt's plus 2**32 is refused.
    Before the fix its ids wrapped to the cached prompt's and it matched 12 cached tokens of it."""
    async with CacheRuntime.open(small_config()) as rt:
        prompt = toks(13, 7)
        await serve(rt, "a", prompt)
        alias = prompt.astype(np.int64) + 2**32
        with pytest.raises(ValidationError) as info:
            assert await rt.match_prefix(alias) == {"device": 0, "host": 0}
        assert isinstance(info.value, errors.TokenError)
        with pytest.raises(errors.TokenError):
            await rt.admit("b", torch.from_numpy(alias))
        await still_serves(rt)


async def test_vocab_size_bounds_the_token_ids():
    """`RuntimeConfig(vocab_size=...)` bounds ids to [0, vocab_size) and is itself validated.
    Before the fix there was no such field (TypeError)."""
    for bad in (0, -1, True, 2**31 + 1, 10.0):
        with pytest.raises(errors.ConfigError):
            small_config(vocab_size=bad)
    async with CacheRuntime.open(small_config(vocab_size=1000)) as rt:
        for bad in ([1, 2, 1000], np.array([1, 2, 1000], dtype=np.int32), torch.tensor([1000, 2])):
            with pytest.raises(errors.TokenError):
                await rt.admit("a", bad)
        t = [999] * 9
        await serve(rt, "a", np.array(t, dtype=np.int32))
        assert await rt.match_prefix(range(991, 1000)) == {"device": 0, "host": 0}
        assert await rt.match_prefix(t) == {"device": 8, "host": 0}
        await quiescent_check(rt)


# -- fail whole, really -------------------------------------------------------------------------


class LogRecorder:
    """Stands in for the supervisor's structlog logger: the events it was given, by level."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **kw: self.events.append((level, event, kw))

    def errors(self) -> list[tuple[str, dict[str, Any]]]:
        return [(e, kw) for lvl, e, kw in self.events if lvl == "error"]


INTERNAL = {"TreeError": lambda: TreeError("tree corrupted half-way"),
            "OwnershipError": lambda: errors.OwnershipError("freed by a non-owner"),
            "PinnedSlotError": lambda: errors.PinnedSlotError("freed while pinned"),
            "SlotMisuseError": lambda: errors.SlotMisuseError("unpin of a page not pinned")}


@pytest.mark.parametrize("batched", [False, True], ids=["call", "step"])
@pytest.mark.parametrize("make", INTERNAL.values(), ids=INTERNAL.keys())
async def test_an_internal_structures_error_half_way_through_a_call_fails_the_runtime(make, batched, monkeypatch):
    """A TreeError, OwnershipError, PinnedSlotError or SlotMisuseError raised by the tree or a ledger
    after a finish changed state is no refusal of the caller's input: the runtime fails (one
    `actor_failed` error event with the cause), every later call raises RuntimeFailed and leaving
    the `async with` re-raises it. Before the fix the finish's caller got the error as a validation
    error (in the step's tuple for a batch) and the runtime carried on with the half-done finish."""
    from runtime import supervisor

    recorder = LogRecorder()
    monkeypatch.setattr(supervisor, "log", recorder)
    with pytest.raises(RuntimeFailed) as outer:
        async with CacheRuntime.open(small_config()) as rt:
            t = toks(12, 8)
            res = await rt.admit("a", t)
            compute(rt, res.slots, t)

            def break_release(core: Any) -> None:
                release = core._kv.release

                def half_then_raise(rec: Any) -> None:
                    release(rec)  # the change happened...
                    raise make()  # ...and then the structure complained

                core._kv.release = half_then_raise

            await rt.inspect(break_release)
            with pytest.raises(RuntimeFailed) as info:
                if batched:
                    await rt.step([Finish("a", t)])
                else:
                    await rt.finish("a", t)
            assert type(info.value.__cause__).__name__ == next(k for k, v in INTERNAL.items() if v is make)
            for later in (rt.available(), rt.admit("b", t), rt.stats()):
                with pytest.raises(RuntimeFailed):
                    await later
    assert outer.value.__cause__ is info.value.__cause__
    [(event, fields)] = recorder.errors()
    assert event == "actor_failed" and fields["actor"] == "tree" and fields["error"] == repr(info.value.__cause__)


@pytest.mark.parametrize("batched", [False, True], ids=["call", "step"])
async def test_a_ledger_validation_error_half_way_through_admit_fails_the_runtime(batched):
    """Errors by origin: a `LengthError` (a ValidationError) that the device ledger raises during an
    admit, after the admit locked its cached prefix and held its ledger code, is a bug of the
    runtime, not a refusal of the caller's input: the runtime fails, the caller gets RuntimeFailed
    with the LengthError as its cause, and nothing serves with the half-done admit (every later call
    raises RuntimeFailed). The invariant checker is off: the phase alone must see it. Checked
    against the type-based rule (`Phase.internal` made to return False): the caller got the
    LengthError as a refusal and the runtime went on serving (with the checker on, it failed a
    message later on "device ledger holds ['request:b#2'], request table rows name []"), so this
    test failed."""
    with pytest.raises(RuntimeFailed) as outer:
        async with CacheRuntime.open(small_config(debug_invariants=False)) as rt:
            t = toks(12, 8)
            await serve(rt, "a", t)  # the cached prefix that "b" hits and locks

            def break_alloc(core: Any) -> None:
                def misused(*args: Any, **kw: Any) -> Any:
                    raise LengthError("num_pages must be a non-negative int, got -1")  # an internal misuse
                core.residency.device.alloc = misused

            await rt.inspect(break_alloc)
            longer = np.concatenate((t, toks(6, 9)))
            with pytest.raises(RuntimeFailed) as info:
                if batched:
                    await rt.step([Admit("b", longer)])
                else:
                    await rt.admit("b", longer)
            assert type(info.value.__cause__) is LengthError
            for later in (rt.available(), rt.admit("c", t), rt.stats(), rt.inspect(lambda core: None)):
                with pytest.raises(RuntimeFailed):
                    await later
    assert outer.value.__cause__ is info.value.__cause__


@pytest.mark.parametrize("how", ["unknown op id", "ack refused as a caller error"])
async def test_an_ack_that_cannot_be_applied_fails_the_runtime_instead_of_vanishing(how):
    """A TransferAck the tree cannot apply has no caller to refuse: the runtime fails.
    Before the fix an ack whose handler raised a CallerError (here StateError, as a tree that checks op
    ids would raise) was dropped silently and the runtime carried on; an unknown op id already
    failed it there (KeyError), which this keeps."""
    with pytest.raises(RuntimeFailed) as outer:
        async with CacheRuntime.open(small_config()) as rt:
            if how != "unknown op id":
                def refuse_acks(core: Any) -> None:
                    def apply_ack(op_id: int, error: str | None) -> None:
                        raise StateError(f"no copy {op_id} in flight")

                    core.apply_ack = apply_ack

                await rt.inspect(refuse_acks)
            rt._tree.mailbox.put_internal(TransferAck(987654, Direction.BACKUP))
            await until(lambda: rt.failed, timeout=2.0)
            with pytest.raises(RuntimeFailed):
                await rt.available()
    if how != "unknown op id":
        assert isinstance(outer.value.__cause__, StateError)


# -- cancellation of the owner ------------------------------------------------------------------


def held_copies_config() -> Any:
    return small_config(write_policy="write_through")  # every finish starts a backup, held by the fake engine


async def test_a_cancel_while_open_is_starting_stops_every_actor():
    """The owner cancelled while `open` is starting the actors: they are stopped and
    the CancelledError reaches the canceller. Before the fix the three actor tasks and the supervisor
    ran on forever."""
    entered = False

    async def owner() -> None:
        nonlocal entered
        async with CacheRuntime.open(small_config()):
            entered = True

    task = asyncio.create_task(owner())
    await asyncio.sleep(0)  # open created the actors' task and waits for it to start them
    assert "hicache-supervisor" in hicache_tasks()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: hicache_tasks() == [])  # (raises if they run on)
    assert not entered


async def test_a_cancelled_owner_with_copies_in_flight_waits_for_them_then_stops():
    """The body cancelled (twice: a shutdown handler that insists) with a backup in
    flight: the close still waits for the copy (never frees a pinned slot), then stops every
    actor, and the CancelledError reaches the canceller. Before the fix the second cancel broke off
    the close while it waited, and the actors ran on forever."""
    holder: list[CacheRuntime] = []

    async def owner() -> None:
        async with CacheRuntime.open(held_copies_config(), engine_factory=FakeCopyEngine) as rt:
            holder.append(rt)
            await serve(rt, "a", toks(24, 9))
            await asyncio.Event().wait()  # serve until cancelled

    task = asyncio.create_task(owner())
    await until(lambda: bool(holder) and bool(holder[0].engine.pending()))
    rt = holder[0]
    task.cancel()
    await until(lambda: task.done() or bool(rt._tree.quiesce_waiters))  # the close holds a drain...
    task.cancel()
    await asyncio.sleep(0.02)  # (a close broken off by the second cancel would end now)
    assert not task.done() and "hicache-tree" in hicache_tasks()  # ...and waits for the copy
    for op in rt.engine.pending():
        rt.engine.release(op)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hicache_tasks() == [] and rt.closed and not rt.failed


async def test_an_anyio_deadline_around_the_body_still_waits_for_the_copies():
    """`anyio.fail_after` cancels the task again at every await while its scope is
    cancelled; the close holds it off, waits for the copy in flight and stops every actor, and the
    deadline's TimeoutError still comes out. Before the fix the close was broken off at its first await
    and the actors ran on forever."""
    holder: list[CacheRuntime] = []

    async def release_later() -> None:
        await until(lambda: bool(holder) and bool(holder[0].engine.pending()))
        await asyncio.sleep(0.15)  # past the deadline: the close is waiting for it
        for op in holder[0].engine.pending():
            holder[0].engine.release(op)

    helper = asyncio.create_task(release_later())
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.1):
            async with CacheRuntime.open(held_copies_config(), engine_factory=FakeCopyEngine) as rt:
                holder.append(rt)
                await serve(rt, "a", toks(24, 10))
                await asyncio.Event().wait()
    await helper
    assert hicache_tasks() == [] and holder[0].closed and not holder[0].failed


async def test_a_timeout_around_the_whole_async_with_stops_the_actors_when_copies_never_land():
    """A deadline that fires while the close waits for copies that never complete:
    after `close_grace_s` the actors are stopped without them (the runtime fails, the copy engine
    is left alone), nothing named hicache-* is left running and the TimeoutError comes out. Before
    the fix the deadline broke off the close and the actors ran on forever."""
    holder: list[CacheRuntime] = []
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            async with CacheRuntime.open(held_copies_config(), engine_factory=FakeCopyEngine) as rt:
                rt.close_grace_s = 0.2
                holder.append(rt)
                await serve(rt, "a", toks(24, 11))
                await until(lambda: bool(rt.engine.pending()))
                # leaving the body: the close waits for the held copy until the deadline
    rt = holder[0]
    assert rt.engine.pending()  # the copy never landed
    await until(lambda: hicache_tasks() == [])
    assert rt.failed
    with pytest.raises(RuntimeFailed):
        await rt.available()
    for op in rt.engine.pending():
        rt.engine.release(op)


# -- the library never configures structlog -----------------------------------------------------


def test_opening_a_runtime_leaves_the_embedders_structlog_configuration_alone():
    """An application configures structlog with its own processor, then imports the
    runtime and opens and closes one that logs (an actor failure): the configuration is still the
    application's, and the runtime's events went to stdlib `logging` (its ``hicache.*`` loggers),
    not through the application's structlog processor. Before the first fix the first
    `get_logger` (at import) replaced the configuration with the library's own."""
    script = textwrap.dedent("""
        import asyncio, logging, sys
        import structlog

        seen, records = [], []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.hicache["event"])

        logging.getLogger("hicache").addHandler(Keep())

        def mine(logger, method, event):
            seen.append(event["event"])
            raise structlog.DropEvent

        structlog.configure(processors=[mine])
        sys.path.insert(0, sys.argv[1])
        from runtime.config import RuntimeConfig
        from runtime.errors import RuntimeFailed
        from runtime.runtime import CacheRuntime

        async def main():
            try:
                async with CacheRuntime.open(RuntimeConfig(device_slots=256, page_size=4)) as rt:
                    await rt.inspect(lambda core: 1 / 0)
            except RuntimeFailed:
                pass

        asyncio.run(main())
        assert structlog.get_config()["processors"] == [mine], structlog.get_config()["processors"]
        assert "actor_failed" in records and not seen, (records, seen)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-2000:]


# -- a cancelled step leaves no admission behind ------------------------------------------------


async def test_a_cancelled_step_releases_its_admissions():
    """A caller cancelled while awaiting `step([...Admit...])` never learns its
    admissions, so the runtime releases them (as for a cancelled `admit`). Before the fix both stayed
    live (live_requests was 2 after the step had been handled)."""
    async with CacheRuntime.open(small_config()) as rt:
        t1, t2 = toks(10, 12), toks(14, 13)
        call = asyncio.create_task(rt.step([Admit("a", t1), Admit("b", t2), Extend("a", 2)]))
        await asyncio.sleep(0)  # the step is in the mailbox; the tree actor has not run it yet
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await rt.available()  # the releases went in after the step; both are handled now
        await rt.available()
        assert (await rt.stats())["requests"]["live"] == 0
        out = await rt.step([Admit("a", t1), Admit("b", t2)])
        assert [r.rid for r in out] == ["a", "b"]
        await rt.step([Abort("a"), Abort("b")])
        await quiescent_check(rt)


def _foreign_calls(rt: CacheRuntime) -> dict[str, Any]:
    """Every public call with valid arguments (coroutine factories; `kv_events` is synchronous)."""
    t = toks(9, 77)
    return {
        "admit": lambda: rt.admit("f", t), "prepare": lambda: rt.prepare("f", t), "extend": lambda: rt.extend("f", 1),
        "decode_step": lambda: rt.decode_step(["f"]), "commit": lambda: rt.commit("f", 1),
        "cache": lambda: rt.cache("f", t), "finish": lambda: rt.finish("f", t), "rewind": lambda: rt.rewind("f", 1),
        "snapshot": lambda: rt.snapshot("f", 4), "open_session": lambda: rt.open_session("s"),
        "close_session": lambda: rt.close_session("s"), "abort": lambda: rt.abort("f"),
        "step": lambda: rt.step([Abort("f")]), "match_prefix": lambda: rt.match_prefix(t),
        "can_admit": lambda: rt.can_admit(t), "available": rt.available, "flush": rt.flush, "stats": rt.stats,
        "refresh_metrics": rt.refresh_metrics, "attach_storage": lambda: rt.attach_storage(object()),
        "detach_storage": rt.detach_storage, "clear_storage": rt.clear_storage,
        "inspect": lambda: rt.inspect(lambda core: None), "close": rt.close,
    }


def _call_from_another_thread(rt: CacheRuntime) -> dict[str, str]:
    """Each public call from a thread of its own with its own event loop (and `kv_events` from a
    thread with none): what each raised, and how long it took."""
    import time

    out: dict[str, str] = {}

    async def each() -> None:
        for name, make in _foreign_calls(rt).items():
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(make(), 2.0)
                out[name] = "returned"
            except asyncio.TimeoutError:
                out[name] = "hung"
            except Exception as exc:  # noqa: BLE001 - recorded for the assertion
                out[name] = type(exc).__name__
            if time.monotonic() - t0 > 0.5:
                out[name] += " (slow)"

    def thread() -> None:
        asyncio.run(each())
        try:
            rt.kv_events()
            out["kv_events"] = "returned"
        except Exception as exc:  # noqa: BLE001
            out["kv_events"] = type(exc).__name__

    import threading

    th = threading.Thread(target=thread)
    th.start()
    th.join(120)
    return out


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_a_call_from_another_threads_loop_fails_at_once(busy):
    """Every public call made from another thread's event loop (and the synchronous `kv_events`
    from a thread with none) raises `ForeignLoopError` at once, whether the runtime is idle or
    serving on its own loop meanwhile, and the runtime carries on. Checked failing without the loop
    check: on the idle runtime every call hung (the mailbox's wake-up is not thread-safe: the
    runtime's loop never woke), and a foreign `close()` broke the close ("attached to a different
    loop")."""
    config = small_config(copy_engine="cpu", host_tokens=64, kv_events=True)
    async with CacheRuntime.open(config) as rt:
        stop = asyncio.Event()

        async def load() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                await serve(rt, f"busy{i}", toks(9, i))
                await asyncio.sleep(0)

        task = asyncio.create_task(load()) if busy else None
        got = await asyncio.to_thread(_call_from_another_thread, rt)
        stop.set()
        if task is not None:
            await task
        assert got == dict.fromkeys([*_foreign_calls(rt), "kv_events"], "ForeignLoopError"), got
        assert issubclass(errors.ForeignLoopError, ValidationError)
        await serve(rt, "after", toks(9, 1))  # the runtime carries on
        assert (await rt.stats())["requests"]["live"] == 0
