"""Differential test of every tier: device hits, host load-backs, storage prefetch, decode
offload and streaming sessions. Every turn of several concurrent multi-turn conversations (tiny
random Llama, fp32) must give the same greedy tokens as transformers' own ``generate`` with no
reuse, and every step's logits must be within 1e-5; each scenario must actually have served
tokens from the tiers it is about.

- all tiers in one run (``test_all_tiers_in_one_run_equal_generate``): one runtime with a
  small device pool, a small host pool, a file storage tier, write-back and decode offload.
  Users chat through a ``ServingLoop`` while streaming sessions run on the runtime directly;
  the sessions are then closed into the tree and their conversations go on through the loop.
  Counted per tier from the turns' ``AdmitResult``: device hits; host load-backs of prefixes
  the device pool evicted; tokens the previous turn's decode offload put on host, loaded back;
  storage prefetches (KV that reached storage through a host copy, e.g. the closed sessions'
  KV written back when the device pool evicted it, then dropped by the host pool); the
  sessions' own KV reused across turns. Each must be > 0.
  ``test_all_tiers_load_off_by_one_page_is_caught`` runs the same scenario with loads that
  read one host page off and requires the comparison to fail.
- storage: ``ServingLoop`` over a runtime with a file storage tier; between turns the copies
  settle and ``flush`` drops device and host, so later turns are prefetched from storage;
- decode offload: ``decode_offload=True``; ``finish`` keeps nothing on device, so later turns
  load the offloaded pages back from host;
- sessions: the runtime driven directly (``ServingLoop`` has no sessions): each conversation
  is a session, every turn ``admit(session=)`` reuses the session's KV on device; the
  sessions' turns decode together as one ragged batch per step (``session_round``).

Storage gets both kinds of host copies: host backups and decode offload's copies are written
through (the latter since the offload write-through fix; the all-tiers test's per-tier figures
were taken before it, when storage served only the closed sessions' KV).
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from runtime.config import RuntimeConfig  # noqa: E402
from runtime.errors import CapacityError  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, PagedSeq, greedy_generate_reference  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.messages import Commit, Direction, Extend, PoolTransfer, TransferPlan  # noqa: E402
from runtime.runtime import CacheRuntime, make_engine  # noqa: E402
from tests.e2e.support import PAGE, TOL, ids, runtime_config  # noqa: E402

USERS, TURNS, NEW = 3, 3, 8
config = functools.partial(runtime_config, device_slots=512)  # model fixture: tests/e2e/conftest.py

SYSTEM = ids(40, 1)


def user_msg(u: int, t: int) -> list[int]:
    return ids(20 + 3 * u, 100 * u + t)


def mismatches(ref_model, results, new: int = NEW, tol: float = TOL, reference=greedy_generate_reference) -> list[str]:
    """results: (rid, prompt, tokens, logits) per turn; each turn generated up to `new` tokens, its
    logits within `tol` of the reference's (``reference(ref_model, prompt, new, return_logits=True)``:
    by default transformers' own generate)."""
    bad = []
    for rid, prompt, tokens, logits in results:
        want, want_logits = reference(ref_model, prompt, new, return_logits=True)
        if tokens != want:
            bad.append(f"{rid} @{len(prompt)}: tokens {tokens} != {want}")
            continue
        for step, (got, exp) in enumerate(zip(logits, want_logits, strict=True)):
            err = (got.to(exp.device) - exp).abs().max().item()
            if not err <= tol:
                bad.append(f"{rid} @{len(prompt)} step {step}: logits off by {err:.2e}")
                break
    return bad


async def settle(rt: CacheRuntime, timeout: float = 10.0) -> None:
    """Until no copy, storage op or offload is in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    busy = lambda core: core.in_flight() + (len(core.offload.retired) if core.offload is not None else 0)  # noqa: E731
    while await rt.inspect(busy):
        assert loop.time() < deadline, "copies still in flight"
        await asyncio.sleep(0.002)


async def evict_to_host(rt: CacheRuntime, srv: ServingLoop, device_slots: int) -> None:
    """A filler request as long as the device pool: every conversation's node is evicted from
    device (write-through: their host copies stay), so the next turns load from host."""
    await srv.generate(ids(device_slots - 2 * PAGE, 9), max_new_tokens=1, rid="filler")
    await settle(rt)


async def serve_turns(rt: CacheRuntime, model, between_turns=None, *, paged=None, turns: int = TURNS) -> list:
    """USERS concurrent conversations through a ServingLoop, turn by turn in lockstep;
    ``between_turns(t, srv)`` after each turn t but the last. ``paged``: the model driver
    (default: ``PagedKVModel`` over the runtime's device pool)."""
    histories = [list(SYSTEM) for _ in range(USERS)]
    results, metrics = [], []
    paged = PagedKVModel(model, rt.device_pool) if paged is None else paged
    async with ServingLoop(rt, paged, eos_token_ids=[2], record_logits=True, max_running=USERS) as srv:
        for t in range(turns):
            async def user(u: int) -> None:
                histories[u] += user_msg(u, t)
                c = await srv.generate(histories[u], max_new_tokens=NEW, rid=f"u{u}")
                results.append((f"u{u}t{t}", list(histories[u]), c.tokens, c.logits))
                metrics.append((t, c.metrics))
                histories[u] += c.tokens

            await asyncio.gather(*(user(u) for u in range(USERS)))
            if between_turns is not None and t < turns - 1:
                await between_turns(t, srv)
    return results, metrics


async def test_storage_prefetch_equals_generate(model, ref_model, tmp_path):
    cfg = config(model, storage_backend="file", storage_dir=str(tmp_path / "kv"))
    async with CacheRuntime.open(cfg) as rt:
        async def drop_device_and_host(*_) -> None:
            await settle(rt)
            assert await rt.flush() > 0
            assert (await rt.match_prefix(SYSTEM + [5] * PAGE)) == {"device": 0, "host": 0}

        results, metrics = await serve_turns(rt, model, drop_device_and_host)
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    later = [m for t, m in metrics if t > 0]
    storage = sum(m.storage_tokens for m in later)
    assert storage > 0 and stats["storage"]["hit_tokens"] > 0, (storage, stats["storage"]["hit_tokens"])
    assert all(m.storage_tokens > 0 for m in later), [m.storage_tokens for m in later]  # own history
    for _, m in metrics:
        assert m.device_tokens + m.host_tokens + m.storage_tokens + m.recomputed_tokens == m.prompt_tokens


async def test_decode_offload_reload_equals_generate(model, ref_model):
    cfg = config(model, decode_offload=True)
    async with CacheRuntime.open(cfg) as rt:
        results, metrics = await serve_turns(rt, model, lambda *_: settle(rt))
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    assert stats["offload"]["issued"] > 0 and stats["offload"]["host_kept_tokens"] > 0, stats
    reloaded = sum(m.host_tokens for t, m in metrics if t > 0)
    assert reloaded > 0 and stats["copies"]["loads_issued"] > 0, (reloaded, stats["copies"]["loads_issued"])


async def retry_capacity(call, timeout: float = 10.0):
    """``await call()``, again while the device pool has no room (write-back evictions free their
    pages only when the backup lands; the serving loop's requests release pages as they finish)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await call()
        except CapacityError:
            assert loop.time() < deadline, "the device pool never had room"
            await asyncio.sleep(0.002)


async def session_round(rt: CacheRuntime, paged: PagedKVModel, turns) -> list:
    """One turn of each session, the runtime driven directly (``ServingLoop`` has no sessions):
    turns = [(sid, rid, prompt)]; ``admit(session=)`` reuses the session's KV on device and the
    turns decode together as one ragged batch per step (the forward in a worker thread, so that
    other tasks of the loop keep running). Returns (tokens, logits, cached_device) per turn."""
    admitted = await asyncio.gather(*(
        retry_capacity(lambda rid=rid, prompt=prompt, sid=sid: rt.admit(rid, np.asarray(prompt, dtype=np.int32),
                                                                          session=sid))
        for sid, rid, prompt in turns))
    n = len(turns)
    rids = [rid for _, rid, _ in turns]
    prompts = [list(prompt) for _, _, prompt in turns]
    slots, starts = [], []
    for res in admitted:
        for r in res.readiness:
            await r.wait_all()
        slots.append(res.slots.to(torch.long))
        starts.append(res.cached_device + res.loaded_host)
    outs: list[list[int]] = [[] for _ in range(n)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    live = list(range(n))
    while live:
        ctxs = {u: prompts[u] + outs[u] for u in live}
        seqs = [PagedSeq(slots=slots[u], start=starts[u], input_ids=ctxs[u][starts[u]:]) for u in live]
        lg = (await asyncio.to_thread(paged.forward, seqs)).logits
        for row, u in enumerate(live):
            logits[u].append(lg[row].detach().clone())
            outs[u].append(int(lg[row].argmax()))
        live = [u for u in live if outs[u][-1] != 2 and len(outs[u]) < NEW]
        for u in live:
            starts[u] = len(ctxs[u])
        step = await rt.step([item for u in live for item in (Commit(rids[u], starts[u]), Extend(rids[u], 1))])
        for k, u in enumerate(live):
            commit, ext = step[2 * k], step[2 * k + 1]
            if isinstance(commit, BaseException):
                raise commit
            if isinstance(ext, CapacityError):
                ext = await retry_capacity(lambda rid=rids[u]: rt.extend(rid, 1))
            elif isinstance(ext, BaseException):
                raise ext
            slots[u] = torch.cat((slots[u], ext.to(torch.long)))
    for u in range(n):
        kv = await rt.finish(rids[u], np.asarray(prompts[u] + outs[u][:-1], dtype=np.int32))
        assert kv == len(prompts[u]) + len(outs[u]) - 1
    return [(outs[u], logits[u], admitted[u].cached_device) for u in range(n)]


async def test_streaming_sessions_equal_generate(model, ref_model):
    """Each conversation a session; the turns of all sessions run as one ragged batch per step."""
    served, results = [], []
    async with CacheRuntime.open(config(model)) as rt:
        paged = PagedKVModel(model, rt.device_pool)
        sids = [f"s{u}" for u in range(USERS)]
        for sid in sids:
            await rt.open_session(sid)
        histories = [list(SYSTEM) for _ in range(USERS)]
        for t in range(TURNS):
            for u in range(USERS):
                histories[u] += user_msg(u, t)
            rids = [f"{sid}t{t}" for sid in sids]
            outs = await session_round(rt, paged, list(zip(sids, rids, histories, strict=True)))
            for u, (tokens, logits, cached) in enumerate(outs):
                results.append((rids[u], list(histories[u]), tokens, logits))
                if t > 0:
                    served.append(cached)
                histories[u] += tokens
        for sid in sids:
            await rt.close_session(sid)
        stats = await rt.stats()
    assert mismatches(ref_model, results) == []
    assert len(served) == USERS * (TURNS - 1) and all(n > 0 for n in served), served
    assert stats["requests"]["live"] == 0


# -- every tier in one run ---------------------------------------------------------------------

SESSIONS, ROUNDS, SESSION_ROUNDS = 2, 5, 2
SESSION_SYSTEM = ids(36, 2)  # the sessions' conversations share no prefix with the users'


def session_msg(k: int, t: int) -> list[int]:
    return ids(18 + 2 * k, 1000 + 100 * k + t)


def all_tiers_config(model, tmp_path) -> RuntimeConfig:
    # 24 device pages: the running turns, the sessions' KV and little else, so cached prefixes are
    # evicted every round; 32 host pages: the offloaded conversations do not all fit either.
    # write_back: a closed session's KV (device-only nodes) is backed up to host when the device
    # pool evicts it, and from there written through to storage.
    return config(model, device_slots=384, host_tokens=512, write_policy="write_back", decode_offload=True,
                  storage_backend="file", storage_dir=str(tmp_path / "kv"))


async def all_tiers_run(model, tmp_path, wrap_engine=None):
    """One runtime, ROUNDS rounds. Each round, concurrently: a turn of each of USERS conversations
    through a ``ServingLoop``; in the first SESSION_ROUNDS rounds a turn of each of SESSIONS
    streaming sessions (``session_round``, the runtime driven directly), after which each session
    is closed with ``insert=True`` and its conversation goes on through the ``ServingLoop`` (session
    k from round SESSION_ROUNDS + 1 + k). Between rounds the copies settle (no flush).

    ``wrap_engine(engine, config)`` wraps the copy engine (the planted bug). Returns
    (results, tiers, loaded, stats): results as ``mismatches`` takes them; tiers: prompt tokens
    served per tier, from each turn's ``AdmitResult`` (``TurnMetrics``; ``session``: the session's
    KV reused by its turns, ``resumed``: what re-admissions after a preemption found cached);
    loaded: per turn, its prompt tokens loaded from host or storage. A token loaded from host
    counts as ``host`` when it lay below what the conversation had on device as tree nodes (its
    previous admission's cached prefix, or the KV its session inserted): the device pool evicted
    it since. Otherwise it counts as ``offloaded``: its previous turn computed it, and only decode
    offload puts a ``ServingLoop`` turn's KV into the tree (its finish inserts nothing on device).
    """
    cfg = all_tiers_config(model, tmp_path)
    engine_factory = None
    if wrap_engine is not None:
        def engine_factory(pools):
            return wrap_engine(make_engine(cfg, *pools["kv"]), cfg)
    results: list = []
    tiers: Counter = Counter()
    loaded: dict[str, int] = {}
    sids = [f"s{k}" for k in range(SESSIONS)]
    history = {f"u{u}": list(SYSTEM) for u in range(USERS)} | {sid: list(SESSION_SYSTEM) for sid in sids}
    on_device: dict[str, int] = {}  # conversation -> tokens it had on device as tree nodes
    async with CacheRuntime.open(cfg, engine_factory=engine_factory) as rt:
        paged = PagedKVModel(model, rt.device_pool)
        for sid in sids:
            await rt.open_session(sid)
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), eos_token_ids=[2], record_logits=True,
                               max_running=USERS + SESSIONS) as srv:
            async def serve(cid: str, r: int, msg: list[int]) -> None:
                history[cid] += msg
                prompt = list(history[cid])
                c = await srv.generate(prompt, max_new_tokens=NEW, rid=cid)
                m = c.metrics
                assert m.cached_tokens + m.recomputed_tokens == m.prompt_tokens == len(prompt)
                lo, hi, below = m.device_tokens, m.device_tokens + m.host_tokens, on_device.get(cid, 0)
                tiers["device"] += m.device_tokens
                tiers["host"] += max(0, min(hi, below) - lo)
                tiers["offloaded"] += max(0, hi - max(lo, below))
                tiers["storage"] += m.storage_tokens
                tiers["resumed"] += m.resume_cached_tokens
                on_device[cid] = m.cached_tokens
                loaded[f"{cid}r{r}"] = m.host_tokens + m.storage_tokens
                results.append((f"{cid}r{r}", prompt, c.tokens, c.logits))
                history[cid] += c.tokens

            async def session_turns(r: int) -> None:
                for k, sid in enumerate(sids):
                    history[sid] += session_msg(k, r)
                turns = [(sid, f"{sid}r{r}", list(history[sid])) for sid in sids]
                outs = await session_round(rt, paged, turns)
                for (sid, rid, prompt), (tokens, logits, cached) in zip(turns, outs, strict=True):
                    results.append((rid, prompt, tokens, logits))
                    tiers["session"] += cached
                    history[sid] += tokens
                if r == SESSION_ROUNDS - 1:
                    for sid in sids:
                        on_device[sid] = await rt.close_session(sid, insert=True)

            for r in range(ROUNDS):
                jobs = [serve(f"u{u}", r, user_msg(u, r)) for u in range(USERS)]
                if r < SESSION_ROUNDS:
                    jobs.append(session_turns(r))
                jobs += [serve(sid, r, session_msg(k, r)) for k, sid in enumerate(sids) if r > SESSION_ROUNDS + k]
                await asyncio.gather(*jobs)
                await settle(rt)
        stats = await rt.stats()
    return results, tiers, loaded, stats


async def test_all_tiers_in_one_run_equal_generate(model, ref_model, tmp_path):
    """Device hits, host load-backs, storage prefetch, decode offload and streaming sessions, all
    in one run: every turn equals ``generate`` and each tier served tokens (when written: device
    688, host 64-96, offloaded 304, storage 176, session 124 tokens over the 22 turns)."""
    results, tiers, _, stats = await all_tiers_run(model, tmp_path)
    assert len(results) == USERS * ROUNDS + SESSIONS * (ROUNDS - 1) - sum(range(SESSIONS))
    assert mismatches(ref_model, results) == []
    for tier in ("device", "host", "storage", "offloaded", "session"):
        assert tiers[tier] > 0, (tier, dict(tiers))
    # the attribution accounts for every token the runtime served from a cache
    assert (stats["device"]["hit_tokens"] + stats["host"]["hit_tokens"]
            == sum(tiers[t] for t in ("device", "host", "offloaded", "storage", "session", "resumed"))), (stats, tiers)
    assert stats["device"]["evicted_tokens"] > 0 and stats["host"]["evicted_tokens"] > 0  # both pools overflowed
    assert stats["copies"]["writeback_deferred_tokens"] > 0 and stats["storage"]["written_pages"] > 0  # closed sessions' KV
    assert stats["storage"]["hit_tokens"] >= tiers["storage"]
    assert stats["offload"]["issued"] > 0 and stats["offload"]["host_kept_tokens"] > 0
    assert stats["requests"]["live"] == 0 and stats["copies"]["failures"] == 0


class LoadOffByOnePage:
    """A copy engine whose host->device loads read the host page after the right one."""

    def __init__(self, inner, cfg: RuntimeConfig) -> None:
        self.inner, self.host_slots, self.loads = inner, cfg.host_slots, 0

    def submit(self, plan: TransferPlan):
        if plan.direction is Direction.LOAD:
            self.loads += 1
            plan = TransferPlan(plan.op_id, plan.direction, tuple(
                PoolTransfer(t.pool, (t.src + PAGE) % self.host_slots, t.dst) for t in plan.transfers))
        return self.inner.submit(plan)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


async def test_all_tiers_load_off_by_one_page_is_caught(model, ref_model, tmp_path):
    """The planted bug: the same run with a copy engine (``engine_factory``) whose host->device
    loads read one host page off (source + one page). The comparison must fail, and for every
    turn that loaded anything from host or storage (a wrong page is never within 1e-5).

    How it was checked (when written): 13 loads were shifted and 15 of the
    22 turns were flagged: the 13 turns that loaded host or storage KV (offloaded, evicted and
    prefetched alike) and 2 whose only hit was a device prefix that a shifted load had put
    there. The 7 that still matched are the first round and the sessions' turns, which reuse no
    loaded KV; with the healthy engine all 22 match (the test above)."""
    engines: list[LoadOffByOnePage] = []

    def broken(inner, cfg):
        engines.append(LoadOffByOnePage(inner, cfg))
        return engines[-1]

    results, tiers, loaded, _ = await all_tiers_run(model, tmp_path, broken)
    assert engines and engines[0].loads > 0, "nothing was loaded: the planted bug was never exercised"
    assert tiers["host"] + tiers["offloaded"] > 0 and tiers["storage"] > 0
    bad = {line.split()[0] for line in mismatches(ref_model, results)}
    assert bad, "a load one page off went unnoticed"
    missed = [rid for rid, n in loaded.items() if n > 0 and rid not in bad]
    assert not missed, f"turns that loaded KV one page off and still matched generate: {missed}"
