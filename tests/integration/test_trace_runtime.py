"""The slot-lifecycle trace of a real runtime: it audits clean, its replay equals the ledgers at
close, and a planted ledger bug (a free that skips the pin check) is reported by the auditor."""

from __future__ import annotations

import json

import numpy as np

from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner
from runtime.messages import Direction
from runtime.runtime import CacheRuntime
from runtime.audit import audit, compare_final_state, main
from tests.integration.support import compute, fake_runtime, release_all, settle, small_config, toks, until


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, reply_len: int = 0) -> tuple[int, int]:
    """One request the way a serving loop runs it (fingerprints stand in for the model)."""
    res = await rt.admit(rid, tokens)
    for r in res.readiness:
        await r.wait_all()
    compute(rt, res.slots, tokens, start=res.cached)
    full = tokens
    if reply_len:
        new = await rt.extend(rid, reply_len)
        full = np.concatenate((tokens, toks(reply_len, 99)))
        compute(rt, np.concatenate((res.slots.numpy(), new.numpy())), full, start=len(tokens))
    await rt.finish(rid, full)
    return res.cached_device, res.loaded_host


def ledgers(core):
    return core.residency.device.snapshot(), core.residency.host.snapshot()


async def test_runtime_trace_audits_clean_and_replays_to_the_ledgers(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    cfg = small_config(device_slots=128, host_tokens=512, copy_engine="cpu", trace_path=str(path))
    async with CacheRuntime.open(cfg) as rt:
        prompts = [toks(60, 10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await serve(rt, f"r{i}", p, reply_len=3)
            await settle(rt)
        # prompt 0 was evicted from device by the later ones: it comes back from host
        _, loaded = await serve(rt, "again", np.concatenate((prompts[0], toks(7, 5))))
        assert loaded > 0
        hit, _ = await serve(rt, "hit", np.concatenate((prompts[0], toks(9, 6))))
        assert hit > 0
        await rt.admit("aborted", toks(20, 7))
        await rt.abort("aborted")
        await settle(rt)
        device, host = await rt.inspect(ledgers)
    report = audit(str(path))
    assert report.clean, report.summary()
    assert compare_final_state(report, [device, host]) == []
    assert audit(str(path), expected=[device, host]).clean
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"alloc", "assign", "pin", "unpin", "free", "backup", "load", "evict"} <= kinds
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert report.cached["device"] > 0 and report.cached["host"] > 0  # tree nodes keep their pages
    assert main([str(path)]) == 0
    assert "CLEAN" in capsys.readouterr().out


def _free_skipping_pin_check(self, slots, owner, **ctx):
    """SlotLedger.free with the planted bug: the pin check is gone (the rest is the real code)."""
    pages = self._pages(slots)
    n = len(pages)
    if n:
        code = self._require_owner(pages, owner, "free")
        self._codes[pages] = 0
        top = self._top
        self._stack[top: top + n] = pages[::-1]
        self._top = top + n
        self._uncount(code, n)
    if self._tracer is not None and self._tracer.active:
        self._tracer.emit("free", self._tier_name, slots=slots, owner=owner, **ctx)


async def test_planted_free_of_pinned_pages_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(SlotLedger, "free", _free_skipping_pin_check)
    path = tmp_path / "trace.jsonl"
    cfg = small_config(trace_path=str(path), debug_invariants=False)  # the checker would catch it first

    def evict_during_backup(core):
        """Evict a node's device copy while its write-through backup still reads it."""
        op = next(op for op in core.copies.ops.values() if op.direction is Direction.BACKUP)
        node = op.node
        assert core.residency.device.pin_count(int(node.device[0])) == 1
        slots = core.residency.tree.detach_device(node, force=True)
        core.residency.device.free(slots, Owner.node(node.id), node=node.id, reason="evict")  # the buggy free lets it through
        return len(slots) // core.page_size, int(slots[0]) // core.page_size, op.op_id

    async with fake_runtime(cfg) as (rt, engine):
        await serve(rt, "a", toks(40, 1))
        await until(lambda: bool(engine.pending()))  # the backup is held in flight
        pages, first, op_id = await rt.inspect(evict_during_backup)
        await release_all(rt, engine)
        device, host = await rt.inspect(ledgers)
    report = audit(str(path))
    (bug,) = report.of_kind("free_while_pinned")
    assert (bug.event, bug.tier, bug.page, bug.pages) == ("free", "device", first, pages)
    assert f"[{op_id}]" in bug.detail
    assert not report.clean and main([str(path)]) == 1
    # the replay follows what the runtime did, so it still ends where the (buggy) ledgers did
    assert compare_final_state(report, [device, host]) == []
