"""The tiers-only connector under vLLM 0.33's real scheduler on CPU (`runtime.integrations.vllm`).

Each test runs the same requests through a vLLM instance with the connector and through a plain
one (no connector) and compares the outputs: the fake forward samples from all the KV a request
reads (`tests/e2e/vllm_engine.py`), so KV served wrong anywhere changes an output. vLLM is
installed by `scripts/install_vllm.sh` (the README's test command runs it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from runtime.integrations.vllm import HiCacheConnector  # noqa: E402
from runtime.messages import Direction  # noqa: E402
from tests.e2e.vllm_engine import BLOCK, FakeEngine, save_tiny_model, vllm_config  # noqa: E402

SYSTEM = list(range(100, 148))  # a 48-token system prompt (3 blocks)


class EagerFreeConnector(HiCacheConnector):
    """A broken variant: lets vLLM free a finished request's blocks while their backup has not
    read them yet (seed 000's class at the engine boundary)."""

    def request_finished(self, request, block_ids):  # type: ignore[no-untyped-def]
        super().request_finished(request, block_ids)
        return False, None

    def get_finished(self, finished_req_ids):  # type: ignore[no-untyped-def]
        super().get_finished(finished_req_ids)
        return None, None  # (nothing was held for it: nothing to hand back)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(str(path))
    return str(path)


def engine(model_dir: str, blocks: int, *, connector: str | None = "HiCacheConnector", host_blocks: int = 128,
           module: str = "runtime.integrations.vllm") -> FakeEngine:
    return FakeEngine(vllm_config(model_dir, connector=connector, module=module, extra={"host_blocks": host_blocks}),
                      blocks)


def conversation(e: FakeEngine, sessions: int, turns: int) -> None:
    """Multi-turn sessions, one turn of every session at a time: each prompt is the system
    prompt, the session's earlier turns and a new message; each turn waits for the last."""
    history = {s: list(SYSTEM) for s in range(sessions)}
    for turn in range(turns):
        for s in range(sessions):
            history[s] += [200 + 37 * s + turn] * 20
            e.add(f"s{s}t{turn}", history[s] + [7], 4)
        e.run()
        for s in range(sessions):
            history[s] += [7] + e.outputs[f"s{s}t{turn}"]


def test_the_host_tier_serves_what_vllms_prefix_cache_evicted_and_outputs_do_not_change(model_dir):
    """Six sessions over a 12-block device pool: vLLM's own prefix cache keeps little, the host
    tier the rest. Outputs equal a plain vLLM's; fewer tokens are computed; nothing leaks."""
    plain, tiered = engine(model_dir, 12, connector=None), engine(model_dir, 12)
    for e in (plain, tiered):
        conversation(e, sessions=6, turns=3)
    assert tiered.outputs == plain.outputs
    stats = tiered.connector.core.stats
    assert stats["tokens_loaded"] > 0 and stats["tokens_backed_up"] > 0
    assert sum(tiered.computed.values()) <= sum(plain.computed.values()) - stats["tokens_loaded"]
    tiered.assert_drained()
    plain.assert_drained()


def test_a_failed_load_is_recomputed_by_vllm_and_outputs_do_not_change(model_dir, monkeypatch):
    plain, tiered = engine(model_dir, 12, connector=None), engine(model_dir, 12)
    copier = tiered.worker.copier
    run, failed = copier.run, []

    def flaky(plan):  # the first two loads fail on the worker
        if plan.direction is Direction.LOAD and len(failed) < 2:
            failed.append(plan.op_id)
            raise RuntimeError("injected copy fault")
        run(plan)

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
        before = len(connector._unloadable)
        after_alloc(request, blocks, num_external_tokens)
        for b in connector._unloadable[before:]:
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
    broken = engine(model_dir, 9, connector="EagerFreeConnector", module=__name__)
    for e in (plain, tiered, broken):
        run(e)
    assert tiered.connector.core.stats["tokens_loaded"] > 0
    assert tiered.outputs == plain.outputs
    assert broken.connector.core.stats["tokens_loaded"] > 0
    assert broken.outputs["c"] != plain.outputs["c"]  # the broken variant is caught
    tiered.assert_drained()
