"""The tiers-only connector under vLLM 0.33's real scheduler on CPU (`runtime.integrations.vllm`).

Each test runs the same requests through a vLLM instance with the connector and through a plain
one (no connector) and compares the outputs: the fake forward samples from all the KV a request
reads (`tests/e2e/vllm_engine.py`), so KV served wrong anywhere changes an output. vLLM is
installed by `scripts/install_vllm.sh` (the README's test command runs it).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from runtime.messages import Direction  # noqa: E402
import torch  # noqa: E402

from tests.e2e.vllm_engine import (  # noqa: E402
    BLOCK,
    HEAD,
    KV_HEADS,
    FakeEngine,
    _extend_hash,
    _prefix_hash,
    expected_block,
    fingerprint,
    save_tiny_model,
    vllm_config,
)

SYSTEM = list(range(100, 148))  # a 48-token system prompt (3 blocks)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(str(path))
    return str(path)


def engine(model_dir: str, blocks: int, *, connector: str | None = "HiCacheConnector", host_blocks: int = 128,
           module: str = "runtime.integrations.vllm", storage_dir: str | None = None,
           max_batched: int = 256) -> FakeEngine:
    extra: dict = {"host_blocks": host_blocks}
    if storage_dir is not None:
        extra["storage_dir"] = storage_dir
    return FakeEngine(vllm_config(model_dir, connector=connector, module=module, extra=extra,
                                  max_batched=max_batched), blocks)


def conversation(e: FakeEngine, sessions: int, turns: int, max_tokens: int = 4) -> None:
    """Multi-turn sessions, one turn of every session at a time: each prompt is the system
    prompt, the session's earlier turns and a new message; each turn waits for the last."""
    history = {s: list(SYSTEM) for s in range(sessions)}
    for turn in range(turns):
        for s in range(sessions):
            history[s] += [200 + 37 * s + turn] * 20
            e.add(f"s{s}t{turn}", history[s] + [7], max_tokens)
        e.run()
        for s in range(sessions):
            history[s] += [7] + e.outputs[f"s{s}t{turn}"]


def test_the_host_tier_serves_what_vllms_prefix_cache_evicted_and_outputs_do_not_change(model_dir, monkeypatch):
    """Six sessions over a 12-block device pool: vLLM's own prefix cache keeps little, the host
    tier the rest. Outputs equal a plain vLLM's; every request computes exactly the tokens that
    neither vLLM's cache nor the host tier supplied (a loaded token is never computed again);
    nothing leaks. The exact count checked failing with the worker reporting every loaded block
    as a load error (outputs still equal: vLLM recomputed them)."""
    plain, tiered = engine(model_dir, 12, connector=None), engine(model_dir, 12)
    connector = tiered.connector
    ask, after_alloc = connector.get_num_new_matched_tokens, connector.update_state_after_alloc
    local: dict[str, int] = {}  # rid -> vLLM's own hit when last asked
    supplied: dict[str, tuple[int, int]] = {}  # rid -> (prompt tokens, tokens vLLM's cache and the tier supplied)

    def asking(request, num_computed_tokens):
        local[request.request_id] = num_computed_tokens
        return ask(request, num_computed_tokens)

    def allocated(request, blocks, num_external_tokens):
        supplied.setdefault(request.request_id,
                            (request.num_prompt_tokens, local[request.request_id] + num_external_tokens))
        after_alloc(request, blocks, num_external_tokens)

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", asking)
    monkeypatch.setattr(connector, "update_state_after_alloc", allocated)
    for e in (plain, tiered):
        conversation(e, sessions=6, turns=3)
    assert tiered.outputs == plain.outputs
    stats = tiered.connector.core.stats
    assert stats["tokens_loaded"] > 0 and stats["tokens_backed_up"] > 0
    assert supplied.keys() == tiered.computed.keys()
    # prefill past what was supplied, then 3 decode steps (a preempted request computes again:
    # async loads hold their blocks while they run, so the small pool preempts now and then)
    exact = [rid for rid in supplied if rid not in tiered.preempted]
    assert len(exact) >= len(supplied) - 2
    for rid in exact:
        prompt, skipped = supplied[rid]
        assert tiered.computed[rid] == prompt - skipped + 3, rid
    # (not `plain - loaded` exactly: a backup runs on the worker's thread, so a finished request's
    # blocks go back to vLLM a step or two later, and vLLM's own hits differ a little from plain's)
    assert sum(tiered.computed.values()) < sum(plain.computed.values()) - stats["tokens_loaded"] // 2
    tiered.assert_drained()
    plain.assert_drained()


def test_a_failed_load_is_recomputed_by_vllm_and_outputs_do_not_change(model_dir, monkeypatch):
    plain, tiered = engine(model_dir, 12, connector=None), engine(model_dir, 12)
    copier = tiered.worker.copier
    run, failed = copier.run, []

    def flaky(plan, limit=None):  # the first two loads fail on the worker
        if plan.direction is Direction.LOAD and len(failed) < 2:
            failed.append(plan.op_id)
            raise RuntimeError("injected copy fault")
        run(plan, limit)

    monkeypatch.setattr(copier, "run", flaky)
    for e in (plain, tiered):
        conversation(e, sessions=6, turns=3)
    assert len(failed) == 2 and tiered.connector.core.stats["load_errors"] == 2
    assert tiered.outputs == plain.outputs
    tiered.assert_drained()


def test_blocks_promised_but_no_longer_held_are_recomputed_and_outputs_do_not_change(model_dir, monkeypatch):
    """The connector's guard for a hit that shrank between the lookup and the load (vLLM calls
    them back to back, so here the lookup over-promises one block): the blocks the tier cannot
    supply are reported as load errors and vLLM recomputes them. The test poisons those blocks;
    checked failing with the worker not reporting them."""
    plain, tiered = engine(model_dir, 12, connector=None), engine(model_dir, 12)
    connector = tiered.connector
    ask, after_alloc = connector.get_num_new_matched_tokens, connector.update_state_after_alloc
    promised: dict[str, int] = {}  # the one request promised a block too many (until vLLM takes it)

    def over_promise(request, num_computed_tokens):
        hit, is_async = ask(request, num_computed_tokens)
        room = num_computed_tokens + hit + BLOCK <= (request.num_tokens - 1) // BLOCK * BLOCK
        if hit and room and (not promised or request.request_id in promised):
            promised[request.request_id] = hit + BLOCK
            return hit + BLOCK, is_async
        return hit, is_async

    def poison_unloadable(request, blocks, num_external_tokens):  # what such a block holds: anything
        before = len(connector._loads)
        after_alloc(request, blocks, num_external_tokens)
        for job in connector._loads[before:]:
            for b in job.unloadable:
                for kv in tiered.kv.values():
                    kv[b] = -1.0

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", over_promise)
    monkeypatch.setattr(connector, "update_state_after_alloc", poison_unloadable)
    for e in (plain, tiered):
        conversation(e, sessions=6, turns=3)
    assert promised, "no hit left room for an over-promise"
    assert tiered.connector.core.stats["tokens_loaded"] > 0
    assert tiered.outputs == plain.outputs
    tiered.assert_drained()


def test_vllm_keeps_a_finished_requests_blocks_until_their_backup_read_them(model_dir):
    """A finishes; B needs every device block, so it runs in the blocks A freed. With
    ``delay_free_blocks`` vLLM holds A's blocks until its backup ran; the eager variant lets B's
    prefill overwrite them first, the host tier keeps B's KV under A's tokens, and C (A's
    prompt again, after B pushed A out of vLLM's cache) is served that KV: its output changes."""

    def run(e: FakeEngine) -> None:
        a = SYSTEM + [300] * 14 + [7]  # 63 tokens: 4 blocks
        e.add("a", a, 1)
        e.add("b", list(range(400, 400 + 127)), 1)  # 127 tokens: all 8 usable blocks
        e.run()
        e.add("c", a + e.outputs["a"] + [9] * 20, 2)
        e.run()

    plain, tiered = engine(model_dir, 9, connector=None), engine(model_dir, 9)
    broken = engine(model_dir, 9, connector="EagerFreeConnector", module="tests.e2e.vllm_engine")
    for e in (plain, tiered, broken):
        run(e)
    assert tiered.connector.core.stats["tokens_loaded"] > 0
    assert tiered.outputs == plain.outputs
    assert broken.connector.core.stats["tokens_loaded"] > 0
    assert broken.outputs["c"] != plain.outputs["c"]  # the broken variant is caught
    tiered.assert_drained()


def test_kv_saved_by_one_instance_is_loaded_by_a_fresh_one_from_storage_byte_identical(model_dir, tmp_path):
    """A serves three sessions and writes every backed-up page through to a shared directory;
    B, a fresh instance (empty GPU cache, empty host tier) on the same directory, serves the same
    prompts: their prefixes are staged from storage into B's host tier (vLLM is told "not known
    yet" until they land), then loaded asynchronously (vLLM waits in WAITING_FOR_REMOTE_KVS);
    every loaded block holds exactly the bytes A computed for those tokens, B computes only the
    tokens past what A stored, and outputs equal a plain vLLM's. Checked failing with the read
    pages placed one page off (`np.roll` of the host pages in `TiersOnlyCore._stage`): block 0
    differs."""
    shared = str(tmp_path / "kv")
    a = engine(model_dir, 32, storage_dir=shared)
    conversation(a, sessions=3, turns=1)
    a.assert_drained()
    assert a.connector.core.storage.stats["storage_pages_written"] > 0

    plain = engine(model_dir, 32, connector=None)
    b = engine(model_dir, 32, storage_dir=shared)
    from_storage: list[str] = []  # requests whose KV a storage read brought
    load = b.worker._load

    def checked_load(job):
        result = load(job)
        if job.load.from_storage:
            from_storage.append(job.rid)
            tokens = list(b.scheduler.requests[job.rid].all_token_ids)
            blocks = b.scheduler.kv_cache_manager.get_block_ids(job.rid)[0]
            last = blocks.index(int(job.load.plan.transfers[0].dst[-1]) // BLOCK)  # the last block it filled
            for i, block in enumerate(blocks[: last + 1]):
                for layer, name in enumerate(b.kv):
                    want = expected_block(tokens, i, layer)
                    assert torch.equal(b.kv[name][block, :, :, :], want), f"block {i} of {job.rid} differs"
        return result

    b.worker._load = checked_load
    for e in (plain, b):
        conversation(e, sessions=3, turns=1)
    assert from_storage, "B loaded nothing from storage"
    stats = b.connector.core.stats
    assert stats["tokens_storage_loaded"] > 0 and stats["load_errors"] == 0
    assert stats["stagings"] == 3 and stats["tokens_staged"] == 3 * 64 and stats["stagings_short"] == 0
    assert b.outputs == plain.outputs
    # never recomputed on B: each 69-token prompt (48 + 20 + 1) computed only what A had not
    # stored, its last 5 tokens, then 3 decode steps; plain computed s0 whole (69 + 3)
    assert plain.computed["s0t0"] == 72
    assert b.computed == {rid: 72 - 64 for rid in plain.computed}
    assert stats["tokens_loaded"] <= 3 * 64  # (a session may find the shared system prompt in vLLM's cache)
    b.assert_drained()


def test_a_staging_read_cut_short_is_a_shorter_hit_and_outputs_do_not_change(model_dir, tmp_path):
    """B's staging reads find only the first page of what the lookup found (pages evicted
    meanwhile): the hit reported is that page, nothing fails, vLLM computes the rest, outputs do
    not change."""
    shared = str(tmp_path / "kv")
    a = engine(model_dir, 32, storage_dir=shared)
    conversation(a, sessions=2, turns=1)
    plain = engine(model_dir, 32, connector=None)
    b = engine(model_dir, 32, storage_dir=shared)
    backend = b.worker.storage
    real = backend.get_prefix

    def first_page_only(keys, dests, tags=None):
        return min(1, real(keys[:1], dests[:1], tags))

    backend.get_prefix = first_page_only
    for e in (plain, b):
        conversation(e, sessions=2, turns=1)
    stats = b.connector.core.stats
    assert stats["tokens_storage_loaded"] == stats["tokens_staged"] == 2 * BLOCK
    assert stats["stagings_short"] == 2 and stats["load_errors"] == stats["loads_short"] == 0
    assert b.connector.core.storage.stats["storage_read_misses"] > 0
    assert not b.errors and b.outputs == plain.outputs
    b.assert_drained()


def test_a_request_aborted_while_its_storage_hit_is_staged_is_not_backed_up_and_its_pages_freed_once(model_dir,
                                                                                                      tmp_path):
    """Y's prefix is in storage (A wrote it), not in B's tiers: B's lookup stages it (a read
    into host pages held for Y) and tells vLLM "not known yet"; Y is aborted while the read runs.
    vLLM frees Y at once (nothing of its blocks is in flight), Y is not backed up, the read goes
    on detached and its pages join B's host tier at its ack; nothing leaks (`check_tiers_only`
    at quiescence: every host page owned once, no staging left)."""
    import threading

    from vllm.v1.request import RequestStatus

    shared = str(tmp_path / "kv")
    y = SYSTEM + [301] * 48 + [7]  # 6 blocks and a token
    a = engine(model_dir, 32, storage_dir=shared)
    a.add("y", y, 1)
    a.run()
    a.assert_drained()
    b = engine(model_dir, 32, storage_dir=shared, host_blocks=12)
    b.worker._stage_inline = False  # (the read on the load lane's thread, as from a remote store)
    gate, stage = threading.Event(), b.worker._stage
    b.worker._stage = lambda request: (gate.wait(10), stage(request))[1]
    b.add("y", y, 1)
    b.step()
    core = b.connector.core
    assert core.staging("y") and b.scheduler.requests["y"].status is RequestStatus.WAITING
    b.step()  # (asked again while the read runs: still not known)
    assert core.staging("y") and b.scheduler.requests["y"].num_computed_tokens == 0
    b.scheduler.finish_requests("y", RequestStatus.FINISHED_ABORTED)
    assert "y" not in b.scheduler.requests and not core.stages and len(core.stage_reads) == 1
    gate.set()
    b.run()
    assert core.stats["tokens_backed_up"] == 0 and "y" not in b.outputs
    assert core.lookup(np.asarray(y), None, 0).host == 6 * BLOCK  # (the detached read's pages landed)
    b.assert_drained()


def test_chunked_prefill_and_preemption_with_the_tiers(model_dir, tmp_path):
    """A 32-token step budget splits every prefill into chunks; a 16-block pool under six sessions
    preempts running requests (vLLM frees their blocks and recomputes or reloads them later).
    Outputs equal a plain vLLM's under the same pressure; nothing leaks."""
    plain = engine(model_dir, 16, connector=None, max_batched=32)
    tiered = engine(model_dir, 16, max_batched=32, storage_dir=str(tmp_path / "kv"))
    for e in (plain, tiered):
        conversation(e, sessions=6, turns=3, max_tokens=24)
    assert tiered.preemptions > 0 and plain.preemptions > 0
    assert tiered.connector.core.stats["tokens_loaded"] > 0
    assert tiered.outputs == plain.outputs
    tiered.assert_drained()
    plain.assert_drained()


def test_a_requests_kept_token_array_is_extended_and_never_used_once_vllm_changed_its_prefix(model_dir):
    """The scheduler side converts a request's token list once and extends the kept array by
    what vLLM appends; a list that no longer ends the kept prefix with the same token (vLLM's
    append-only contract broken) is converted whole again. Checked failing with the contract
    check removed (the stale array came back as the request's tokens)."""
    from types import SimpleNamespace

    conn = engine(model_dir, 64).connector
    ids = list(range(10, 42))
    req = SimpleNamespace(request_id="r", all_token_ids=ids)
    first = conn._tokens_of(req)
    assert first.tolist() == ids
    ids += [7, 8, 9]
    grown = conn._tokens_of(req)
    assert grown.tolist() == ids and grown[:32].tobytes() == first.tobytes()
    assert conn._tokens_of(req) is grown  # nothing new: the kept array itself
    ids[-1] = 99  # the prefix the kept array holds changed under it
    assert conn._tokens_of(req).tolist() == ids
    del ids[20:]  # shorter than the kept array
    assert conn._tokens_of(req).tolist() == ids


@pytest.mark.parametrize("spec", ["SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec"])
def test_a_kv_cache_group_that_is_not_full_attention_is_refused(model_dir, tmp_path, spec):
    """A sliding-window group's blocks out of the window are vLLM's null block (a backup would
    store it as those tokens' KV), a Mamba group's hold states and an MLA group's latents: the
    connector refuses them before it opens anything (the storage directory stays untouched)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1 import kv_cache_interface as kvi

    from runtime.errors import ConfigError
    from runtime.integrations.vllm import HiCacheConnector

    attention = dict(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float32)
    made = {"SlidingWindowSpec": lambda: kvi.SlidingWindowSpec(**attention, sliding_window=64),
            "MLAAttentionSpec": lambda: kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD,
                                                             dtype=torch.float32),
            "MambaSpec": lambda: kvi.MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))}[spec]()
    names = ["model.layers.0.self_attn.attn"]
    kvc = kvi.KVCacheConfig(num_blocks=32, kv_cache_tensors=[], kv_cache_groups=[kvi.KVCacheGroupSpec(names, made)])
    store = tmp_path / "kv"
    config = vllm_config(model_dir, connector="HiCacheConnector", extra={"storage_dir": str(store)})
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=f"FullAttentionSpec KV cache group for now, got {spec}"):
            HiCacheConnector(config, role, kvc)
    assert not store.exists()
