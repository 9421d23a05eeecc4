"""A randomized fuzzer over the whole vLLM connector, driven through vLLM 0.33's real scheduler.

Each episode draws an engine (device pool 10-48 blocks, so vLLM preempts; a step budget of
16-256 tokens, so prefills are chunked; a host tier of 3-64 blocks, so it evicts between a
lookup and its load; storage on or off, shared by the instances of the episode), faults (device
copies that fail or run slowly on the worker's thread, storage calls that fail or read short),
and a workload: multi-turn sessions over a few shared system prompts whose turns start at random
steps, under a few tenants (vLLM cache salts, which the fake forward's fingerprints start from),
random aborts of running requests (and of requests whose load, or the staging of whose storage
hit, runs: loads and staging reads run in the step or, in half the episodes each, on the load
lane's thread, landing steps later), and, with storage, the instance shut down halfway and a
fresh one started on the same directory. A third of the episodes run under vLLM's default load
failure policy ("fail": a failed load ends its request with an error), the rest "recompute".

The oracle is the fake forward's own arithmetic (`tests/e2e/vllm_engine.py`): a request's output
is a function of its token ids alone when every KV value it reads is right, so `expected_output`
computes it without any engine. Checked:
- every finished request's output is exactly that; an aborted one's is a prefix of it;
- after every step, the tiers-only core's invariants (`check_tiers_only`);
- every hit reported to vLLM is loaded in full (no load covers less than its report), and with
  no fault injected no request fails;
- at the end of each instance, nothing leaked: vLLM's blocks, host pages, pins, copies, storage
  operations, the worker's jobs (`FakeEngine.assert_drained`).

A `Violation` names what was wrong, the seed and the step; `python -m tests.fuzz.connector_harness
--seed S --episodes N` runs episodes from the command line. Planted bugs (`PLANTS`) are
connector variants the fuzzer must find (tests/fuzz/test_connector_fuzz.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from vllm.v1.request import RequestStatus  # noqa: E402

import runtime.integrations.vllm.connector as vllm_integration  # noqa: E402
from runtime.integrations.vllm import HiCacheConnector, LoadJob  # noqa: E402
from runtime.integrations.vllm.scheduler import HiCacheConnectorScheduler  # noqa: E402
from runtime.integrations.vllm.worker import HiCacheConnectorWorker  # noqa: E402
from runtime.integrations.vllm.invariants import check_tiers_only  # noqa: E402
from runtime.messages import PoolTransfer, TransferPlan  # noqa: E402
from runtime.storage.backend import FaultPlan, FaultyBackend  # noqa: E402
from runtime.storage.hashing import page_hashes  # noqa: E402
from tests.e2e.vllm_engine import (  # noqa: E402
    BLOCK,
    EagerFreeConnector,
    LAYERS,
    VOCAB,
    FakeEngine,
    _extend_hash,
    _seed,
    expected_block,
    fingerprint,
    save_tiny_model,
    vllm_config,
)

MODULE = __name__


class Violation(AssertionError):
    """The fuzzer's finding: what was wrong, where."""


def expected_output(prompt: list[int], max_tokens: int, salt: str | None = None) -> list[int]:
    """What the fake forward samples for `prompt` when every KV value it reads is right: the
    sum over every position's fingerprint in every layer, modulo the vocabulary, token by token."""
    h = _seed(salt)
    total = 0.0
    for t in prompt:
        h = _extend_hash(h, t)
        total += sum(fingerprint(h, layer) for layer in range(LAYERS))
    out: list[int] = []
    while True:
        token = int(total) % (VOCAB - 10) + 10
        out.append(token)
        if len(out) == max_tokens:
            return out
        h = _extend_hash(h, token)
        total += sum(fingerprint(h, layer) for layer in range(LAYERS))


# -- faults ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Faults:
    copy_fail: float = 0.0  # a device copy (load or backup) raises
    copy_slow: float = 0.0  # a device copy first sleeps a few ms (the engine steps on meanwhile)
    storage: FaultPlan | None = None


def _faulty_copier(copier: Any, rng: random.Random, faults: Faults) -> None:
    run = copier.run

    def faulty_run(plan: Any, limit: int | None = None) -> None:
        if rng.random() < faults.copy_slow:
            time.sleep(rng.uniform(0.001, 0.006))
        if rng.random() < faults.copy_fail:
            raise RuntimeError("injected copy fault")
        run(plan, limit)

    copier.run = faulty_run


class CheckedBackend:
    """A storage backend that compares every page written or read with the KV its key names
    (`expected`, filled by the harness from the token ids of the requests it sent); what differs
    is listed in `wrong` (the worker's thread cannot fail the episode itself)."""

    def __init__(self, inner: Any, expected: dict[bytes, torch.Tensor], wrong: list[str]) -> None:
        self.inner, self.expected, self.wrong = inner, expected, wrong
        self.page_bytes = inner.page_bytes

    def exists_prefix(self, keys: Any) -> int:
        return self.inner.exists_prefix(keys)

    def get_batch(self, keys: Any, dests: Any, tags: Any = None) -> list[bool]:
        got = self.inner.get_batch(keys, dests, tags)
        self._compare("read", keys, dests, got)
        return got

    def set_batch(self, keys: Any, srcs: Any, tags: Any = None) -> list[bool]:
        self._compare("written", keys, srcs, [True] * len(keys))
        return self.inner.set_batch(keys, srcs, tags)

    def close(self) -> None:
        self.inner.close()

    def _compare(self, what: str, keys: Any, pages: Any, ok: list[bool]) -> None:
        for key, page, hit in zip(keys, pages, ok):
            want = self.expected.get(bytes(key))
            if hit and want is not None and not torch.equal(page, want):
                self.wrong.append(f"storage page {bytes(key).hex()[:12]} {what} with KV of other tokens")


def expect_pages(expected: dict[bytes, torch.Tensor], tokens: list[int], identity: Any, salt: str | None) -> None:
    """Record the KV of each whole page of `tokens` (a tenant's: `salt`) under its storage key."""
    n = len(tokens) // BLOCK * BLOCK
    if n == 0:
        return
    namespace = None if salt is None else ("vllm", None, salt)  # (the connector's `_namespace`)
    for i, key in enumerate(page_hashes(np.asarray(tokens[:n], dtype=np.int32), BLOCK, namespace, identity)):
        if key not in expected:
            expected[key] = torch.stack([expected_block(tokens, i, layer, salt) for layer in range(LAYERS)])


# -- planted bugs: connector variants the fuzzer must find ----------------------------------------
class _LoadErrorsDroppedWorker(HiCacheConnectorWorker):
    def get_block_ids_with_load_errors(self):  # type: ignore[no-untyped-def]
        super().get_block_ids_with_load_errors()
        return set()


class LoadErrorsDropped(HiCacheConnector):
    """Blocks a failed load never filled are not reported: vLLM computes on what they held."""

    Worker = _LoadErrorsDroppedWorker


class _LoadOnePageLateScheduler(HiCacheConnectorScheduler):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):  # type: ignore[no-untyped-def]
        n = len(self._loads)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if len(self._loads) == n:
            return
        job = self._loads[-1]
        plan = job.load.plan
        if plan is None or len(plan.transfers[0].src) <= self.block_size:
            return
        t = plan.transfers[0]
        src = t.src.clone()
        src[: -self.block_size] = t.src[self.block_size:]
        shifted = TransferPlan(plan.op_id, plan.direction, (PoolTransfer(t.pool, src, t.dst),))
        self._loads[-1] = LoadJob(job.rid, dataclasses.replace(job.load, plan=shifted), job.unloadable)


class LoadOnePageLate(HiCacheConnector):
    """A load plan's blocks are shifted by one page (the host pages of the wrong positions)."""

    Scheduler = _LoadOnePageLateScheduler


class _StagedOnePageOffWorker(HiCacheConnectorWorker):
    def _stage(self, request):  # type: ignore[no-untyped-def]
        if len(request.pages) > 1:
            request = request._replace(pages=request.pages[1:] + request.pages[:1])
        return super()._stage(request)


class StagedOnePageOff(HiCacheConnector):
    """A staging read writes each storage page into the host page of the next one: the staged
    pages join the host tier holding the wrong KV."""

    Worker = _StagedOnePageOffWorker


class _UnheldScheduler(HiCacheConnectorScheduler):
    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        core = self.core
        core.reserve = lambda rid, *a, stage=False, storage=True, **k: core.lookup(*a, **k)  # type: ignore[method-assign]


class UnheldHits(HiCacheConnector):
    """A hit is reported without holding what its load needs, and a storage hit without staging
    it (the connector before holds): host pages evicted or taken, or storage pages gone, between
    the report and the load leave blocks promised unfilled."""

    Scheduler = _UnheldScheduler


class _SaltBlindScheduler(HiCacheConnectorScheduler):
    _namespace = staticmethod(lambda request: None)


class SaltBlind(HiCacheConnector):
    """Every request in one namespace: a tenant's cached prefix is served to another tenant with
    the same tokens under a different cache salt."""

    Scheduler = _SaltBlindScheduler


# plants only a storage read shows: their searches skip episodes without storage
STORAGE_PLANTS = frozenset({"staged_one_page_off"})

PLANTS: dict[str, type[HiCacheConnector]] = {
    "salt_blind": SaltBlind,
    "staged_one_page_off": StagedOnePageOff,
    "eager_free": EagerFreeConnector,
    "load_errors_dropped": LoadErrorsDropped,
    "load_one_page_late": LoadOnePageLate,
    "unheld_hits": UnheldHits,
}


@dataclass
class StorageChecks:
    expected: dict[bytes, torch.Tensor] = field(default_factory=dict)  # page key -> its KV
    wrong: list[str] = field(default_factory=list)


# -- one episode -----------------------------------------------------------------------------------
@dataclass
class Episode:
    seed: int
    plant: str | None = None
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0  # requests vLLM ended with an error (a failed load under the "fail" policy)
    preemptions: int = 0
    instances: int = 0
    stats: dict[str, int] = field(default_factory=dict)

    def where(self, step_of: str) -> str:
        return f"seed {self.seed}{f' (plant {self.plant})' if self.plant else ''}, {step_of}"


def run_episode(seed: int, model_dir: str, plant: str | None = None) -> Episode:
    rng = random.Random(seed)
    ep = Episode(seed, plant)
    blocks = rng.choice([10, 12, 16, 24, 48])
    max_batched = rng.choice([16, 32, 64, 256])
    host_blocks = rng.choice([3, 4, 6, 12, 64])
    storage = rng.random() < 0.6
    faults = Faults(copy_fail=rng.choice([0.0, 0.0, 0.05, 0.2]), copy_slow=rng.choice([0.0, 0.3, 0.8]),
                    storage=FaultPlan(fail_rate=rng.choice([0.0, 0.1]), page_fail_rate=rng.choice([0.0, 0.1]),
                                      stall_rate=rng.choice([0.0, 0.5]), stall_s=0.004,  # (slow reads wait steps)
                                      mode=rng.choice(["raise", "miss"]), seed=seed) if storage else None)
    # vLLM's default load failure policy ("fail": a load that fails ends its request with an error)
    # in a third of the episodes (its own draw: the episodes' other draws stay as they were)
    policy = "fail" if random.Random(f"{seed}:policy").random() < 1 / 3 else "recompute"
    faultless = faults.copy_fail == 0 and (faults.storage is None or faults.storage.fail_rate == 0 ==
                                           faults.storage.page_fail_rate)
    systems = [[rng.randrange(10, VOCAB) for _ in range(rng.choice([16, 24, 40]))] for _ in range(2)]
    sessions = rng.randint(2, 8)
    turns = rng.randint(2, 6)
    history = {s: list(rng.choice(systems)) for s in range(sessions)}
    # tenants: the same system prompts under different cache salts must never share KV
    salt = {s: rng.choice([None, None, "tenant-a", "tenant-b"]) for s in range(sessions)}
    turn_of = {s: 0 for s in range(sessions)}
    live: dict[str, tuple[int, list[int], int, str | None]] = {}  # rid -> (session, prompt, max_tokens, salt)
    if plant in STORAGE_PLANTS and not storage:
        return ep  # (drawn as every search draws it, not run: the plant cannot show here)
    storage_dir = tempfile.mkdtemp(prefix="hicache-connector-fuzz-") if storage else None
    restart_at = sessions * turns // 2 if storage and rng.random() < 0.5 else -1
    started = 0
    expected_pages: dict[tuple[int, bytes, int], torch.Tensor] = {}
    checks = StorageChecks()
    try:
        e = _engine(model_dir, blocks, max_batched, host_blocks, storage_dir, faults, rng, plant, seed, checks,
                    policy)
        ep.instances = 1
        while any(t < turns for t in turn_of.values()) or live:
            restarting = 0 <= restart_at <= started
            if restarting and not live:  # a fresh instance on the same directory
                _drain(e, ep)
                e = _engine(model_dir, blocks, max_batched, host_blocks, storage_dir, faults, rng, plant, seed, checks,
                    policy)
                ep.instances += 1
                restart_at = -1
                expected_pages.clear()
                restarting = False
            idle = [s for s, t in turn_of.items() if t < turns and all(v[0] != s for v in live.values())]
            abort = None
            if idle and not restarting and (not live or rng.random() < 0.4):
                s = rng.choice(idle)
                history[s] += [rng.randrange(10, VOCAB) for _ in range(rng.choice([1, 5, 16, 21]))]
                rid = f"s{s}t{turn_of[s]}i{ep.instances}"
                max_tokens = rng.choice([1, 3, 8, 17])
                e.add(rid, history[s], max_tokens, salt[s])
                if storage_dir is not None:
                    expect_pages(checks.expected, history[s], e.connector.identity, salt[s])
                live[rid] = (s, list(history[s]), max_tokens, salt[s])
                turn_of[s] += 1
                started += 1
            elif live and rng.random() < 0.01:
                abort = rng.choice(sorted(live))
            elif rng.random() < 0.3:  # a request aborted while its load, or the staging of its hit, runs
                loading = [r for r in live if e.scheduler.requests[r].status is RequestStatus.WAITING_FOR_REMOTE_KVS
                           or e.connector.core.staging(r)]
                abort = rng.choice(sorted(loading)) if loading else None
            if abort is not None and abort not in e.finished:
                e.scheduler.finish_requests(abort, RequestStatus.FINISHED_ABORTED)
                _check_output(ep, e, abort, live.pop(abort), aborted=True)
                ep.aborted += 1
            if e.scheduler.has_requests():
                try:
                    e.step()
                except AssertionError as exc:  # the forward's check of what a request reads, or vLLM's own
                    raise Violation(f"{ep.where(f'step {ep.steps + 1}')}: {_describe(exc)}") from exc
                ep.steps += 1
                try:
                    check_tiers_only(e.connector.core)
                except AssertionError as exc:
                    raise Violation(f"{ep.where(f'step {ep.steps}')}: invariant: {exc}") from exc
                wrong = check_host_content(e, expected_pages) or (checks.wrong[0] if checks.wrong else None)
                if wrong is not None:
                    raise Violation(f"{ep.where(f'step {ep.steps}')}: {wrong}")
                wrong = _broken_promise(e, faultless)
                if wrong is not None:
                    raise Violation(f"{ep.where(f'step {ep.steps}')}: {wrong}")
            for rid in [r for r in live if r in e.finished]:
                s, prompt, max_tokens, _ = entry = live.pop(rid)
                _check_output(ep, e, rid, entry, aborted=rid in e.errors)  # (a failed one: a prefix)
                history[s] += e.outputs[rid]
                if storage_dir is not None:
                    expect_pages(checks.expected, history[s], e.connector.identity, salt[s])
                ep.finished += 1
            if ep.steps > 20_000:
                raise Violation(f"{ep.where(f'step {ep.steps}')}: the engine did not drain")
        _drain(e, ep)
        return ep
    finally:
        if storage_dir is not None:
            shutil.rmtree(storage_dir, ignore_errors=True)


def _engine(model_dir: str, blocks: int, max_batched: int, host_blocks: int, storage_dir: str | None,
            faults: Faults, rng: random.Random, plant: str | None, seed: int, checks: "StorageChecks",
            policy: str) -> FakeEngine:
    extra: dict[str, Any] = {"host_blocks": host_blocks}
    if storage_dir is not None:
        extra["storage_dir"] = storage_dir
    name = PLANTS[plant].__name__ if plant else "HiCacheConnector"
    module = MODULE if plant else "runtime.integrations.vllm"
    open_storage = vllm_integration._open_storage
    if storage_dir is not None:  # both sides' backends checked, and failing by the episode's plan
        def checked_open(*args: Any) -> Any:
            backend = CheckedBackend(open_storage(*args), checks.expected, checks.wrong)
            return backend if faults.storage is None else FaultyBackend(backend, faults.storage)
        vllm_integration._open_storage = checked_open
    try:
        e = FakeEngine(vllm_config(model_dir, connector=name, module=module, extra=extra, max_batched=max_batched,
                                   max_seqs=8, failure_policy=policy), blocks, check_reads=True)
    finally:
        vllm_integration._open_storage = open_storage
    _faulty_copier(e.worker._copier(), random.Random(f"{seed}:copies"), faults)
    if storage_dir is not None:  # staging reads in the step, or on the load lane's thread (a remote store's way)
        e.worker._stage_inline = random.Random(f"{seed}:stage-lane").random() < 0.5
    # loads in the step, or on the load lane's thread, landing steps later (as a GPU's side stream's:
    # each takes a few ms there, so that a request can be aborted or preempted while it runs)
    e.worker._load_inline = random.Random(f"{seed}:load-lane").random() < 0.5
    if not e.worker._load_inline:
        load = e.worker._load
        e.worker._load = lambda job: (time.sleep(0.003), load(job))[1]  # type: ignore[method-assign]
    return e


def _broken_promise(e: FakeEngine, faultless: bool) -> str | None:
    """A hit reported to vLLM that the connector could not load in full (the tiers lost its pages
    between the report and the load), or, with no fault injected, a request vLLM failed (a load
    failed under the "fail" policy); a description, else None."""
    short = e.connector.core.stats["loads_short"]
    if short:
        return f"{short} load(s) covered less than the hit reported to vLLM"
    if faultless and e.errors:
        return f"requests {sorted(e.errors)} failed with no fault injected"
    return None


def check_host_content(e: FakeEngine, cache: dict[tuple[int, bytes, int], torch.Tensor]) -> str | None:
    """Every tree node's host pages (in the worker's host pool) hold the KV of its path's tokens,
    the fake forward's fingerprints; a description of the first that does not, else None.
    `cache` keeps each node's expected pages (by node id, path and own length)."""
    host = e.worker.copier.host if e.worker.copier is not None else None
    if host is None:
        return None
    tree = e.connector.core.residency.tree
    for node in tree.nodes():
        path = tree.path_tokens(node)
        key = (node.id, path.tobytes(), len(node.key))  # (a split keeps the lower half's id and path)
        want = cache.get(key)
        if want is None:
            tokens = path.tolist()
            first = (len(tokens) - len(node.key) // 4) // BLOCK
            ns = node.extra_key
            salt = ns[2] if isinstance(ns, tuple) else None
            want = cache[key] = torch.stack([
                torch.stack([expected_block(tokens, i, layer, salt) for layer in range(LAYERS)])
                for i in range(first, len(tokens) // BLOCK)])
        pages = torch.from_numpy(node.host[::BLOCK] // BLOCK)
        got = host[pages]
        if not torch.equal(got, want):
            bad = next(i for i in range(len(pages)) if not torch.equal(got[i], want[i]))
            return (f"tree node {node.id} ({len(path)} path tokens) holds wrong KV in host page "
                    f"{int(pages[bad])} (its page {bad} of {len(pages)})")
    return None


def _check_output(ep: Episode, e: FakeEngine, rid: str, live: tuple[int, list[int], int, str | None], *,
                  aborted: bool) -> None:
    _, prompt, max_tokens, salt = live
    want = expected_output(prompt, max_tokens, salt)
    got = e.outputs.get(rid, [])
    if (got != want[: len(got)]) if aborted else (got != want):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise Violation(f"{ep.where(f'step {ep.steps}')}: request {rid} ({len(prompt)} prompt tokens"
                        f"{', aborted' if aborted else ''}) sampled {got} where its KV gives {want}: "
                        f"first wrong token at output {first}")


def _describe(exc: AssertionError) -> str:
    """The assertion's message, or where it failed (vLLM's own asserts carry none)."""
    if str(exc):
        return str(exc)
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"assertion failed in {Path(frame.filename).name}:{frame.lineno} ({frame.line})"


def _drain(e: FakeEngine, ep: Episode) -> None:
    try:
        e.run(max_steps=e.steps + 20_000)
    except AssertionError as exc:
        raise Violation(f"{ep.where('draining')}: {_describe(exc)}") from exc
    try:
        e.assert_drained()
    except AssertionError as exc:
        raise Violation(f"{ep.where('at the end')}: leaked: {exc}") from exc
    ep.preemptions += e.preemptions
    ep.failed += len(e.errors)
    for k, v in e.connector.core.stats.items():
        ep.stats[k] = ep.stats.get(k, 0) + v
    e.worker.shutdown()
    e.connector.shutdown()


def run(seed: int, episodes: int, model_dir: str, plant: str | None = None) -> dict[str, Any]:
    """Episodes `seed`, `seed + 1`, ...; stops at the first violation. Returns a JSON-able summary."""
    totals: dict[str, int] = {}
    out: dict[str, Any] = {"seed": seed, "plant": plant, "found": False, "episodes": 0}
    t0 = time.perf_counter()
    for i in range(episodes):
        try:
            ep = run_episode(seed + i, model_dir, plant)
        except Violation as exc:
            out.update(found=True, violation=str(exc)[:2000], episode_seed=seed + i)
            break
        out["episodes"] += 1
        for k in ("steps", "finished", "aborted", "failed", "preemptions", "instances"):
            totals[k] = totals.get(k, 0) + getattr(ep, k)
        for k in ("tokens_loaded", "tokens_storage_loaded", "tokens_backed_up", "load_errors", "backup_errors",
                  "hits_cut", "storage_reads_short", "stagings", "stagings_short", "tokens_staged"):
            totals[k] = totals.get(k, 0) + ep.stats.get(k, 0)
    out.update(totals, seconds=round(time.perf_counter() - t0, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--episodes", type=int, default=20)
    ap.add_argument("--plant", choices=sorted(PLANTS), default=None)
    args = ap.parse_args()
    model_dir = tempfile.mkdtemp(prefix="tiny-llama-")
    save_tiny_model(model_dir)
    out = run(args.seed, args.episodes, model_dir, args.plant)
    print(json.dumps(out))
    sys.exit(1 if out["found"] and args.plant is None else 0)


if __name__ == "__main__":
    main()
