"""The vLLM connector as a user runs it: vLLM's default load failure policy, storage that fails
and heals, vLLM's own metrics and logging (vLLM 0.33's real scheduler on CPU, `vllm_engine.py`).

The workload: 24 sessions of a shared system prompt, each turn a new user message on top of the
session's history, every session's turn sent at once, four turns; a GPU pool of 120 blocks, so
vLLM's prefix cache keeps little and the host tier and storage serve the rest.
"""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from tests.e2e.vllm_engine import FakeEngine, save_tiny_model, vllm_config  # noqa: E402

SYSTEM = list(range(100, 164))  # a 64-token system prompt (4 blocks)
SESSIONS, TURNS, USER, REPLY, GPU_BLOCKS = 24, 4, 40, 8, 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(str(path))
    return str(path)


def engine(model_dir: str, *, connector: bool = True, host_blocks: int = 64, storage_dir: str | None = None,
           policy: str = "fail") -> FakeEngine:
    extra: dict = {"host_blocks": host_blocks}
    if storage_dir is not None:
        extra["storage_dir"] = storage_dir
    return FakeEngine(vllm_config(model_dir, connector="HiCacheConnector" if connector else None, extra=extra,
                                  failure_policy=policy), GPU_BLOCKS)


def sessions(e: FakeEngine, turns: range = range(TURNS), history: dict[int, list[int]] | None = None,
             between=None) -> dict[int, list[int]]:
    """Run `turns` of every session (`between(turn)` before each); returns the histories."""
    history = history if history is not None else {s: list(SYSTEM) for s in range(SESSIONS)}
    for t in turns:
        if between is not None:
            between(t)
        for s in range(SESSIONS):
            history[s] += [(200 + 37 * s + 11 * t + i) % 990 + 10 for i in range(USER)]
            e.add(f"s{s}t{t}", history[s], REPLY)
        e.run()
        for s in range(SESSIONS):
            history[s] += e.outputs[f"s{s}t{t}"]
    return history


@pytest.fixture(scope="module")
def plain_outputs(model_dir) -> dict[str, list[int]]:
    e = engine(model_dir, connector=False)
    sessions(e)
    return e.outputs


# -- a reported hit is one the connector can load ---------------------------------------------------
@pytest.mark.parametrize("host_blocks", [32, 64, 128])
def test_no_request_fails_under_vllms_default_policy_with_small_host_tiers(model_dir, plain_outputs, tmp_path,
                                                                            host_blocks):
    """Host tiers not much larger than the GPU pool, storage behind them, vLLM's default
    `kv_load_failure_policy: "fail"`: no request fails, every output equals plain vLLM's, no load
    covers less than the hit vLLM was told, and the hits cut to the host room there was are
    counted. Checked failing with hits reported unheld (`TiersOnlyCore.reserve` as `lookup`, the
    connector before holds): 10-17 (host 32), 15-18 (64) and 5-7 (128) of the 96 requests failed
    in three runs each."""
    e = engine(model_dir, host_blocks=host_blocks, storage_dir=str(tmp_path / "kv"))
    sessions(e)
    stats = e.connector.core.stats
    assert not e.errors, f"{len(e.errors)} of {SESSIONS * TURNS} requests failed: {sorted(e.errors)}"
    assert e.outputs == plain_outputs
    assert stats["loads_short"] == 0 and stats["load_errors"] == 0 and stats["storage_reads_short"] == 0
    assert stats["tokens_storage_loaded"] > 0
    if host_blocks == 32:  # (the smallest tier cannot hold every hit it is asked for)
        assert stats["hits_cut"] > 0 and stats["tokens_hit_cut"] > 0
    e.assert_drained()
