"""The vLLM connector as a user runs it: vLLM's default load failure policy, storage that fails
and heals, vLLM's own metrics and logging (vLLM 0.33's real scheduler on CPU, `vllm_engine.py`).

The workload: 24 sessions of a shared system prompt, each turn a new user message on top of the
session's history, every session's turn sent at once, four turns; a GPU pool of 120 blocks, so
vLLM's prefix cache keeps little and the host tier and storage serve the rest.
"""

from __future__ import annotations

import shutil
import time

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


# -- a storage hit is staged before it is reported -------------------------------------------------
def _remove_pages_after_hits(e: FakeEngine, root) -> list[int]:
    """Every page file under `root` removed right after each lookup of `e`'s that found a hit
    (a number of tokens, or None: a storage hit being staged); returns the files removed each
    time."""
    ask = e.connector.get_num_new_matched_tokens
    removed: list[int] = []

    def ask_then_remove(request, num_computed_tokens):
        n, load_async = ask(request, num_computed_tokens)
        if n is None or n:
            pages = [p for p in root.rglob("*.kv")]
            for p in pages:
                p.unlink(missing_ok=True)
            removed.append(len(pages))
        return n, load_async

    e.connector.get_num_new_matched_tokens = ask_then_remove
    return removed


def test_pages_removed_right_after_each_lookup_that_found_them_are_a_shorter_hit_never_a_failed_request(
        model_dir, plain_outputs, tmp_path):
    """vLLM's default `kv_load_failure_policy: "fail"`, a host tier smaller than the GPU pool,
    storage behind it, and every page file of the storage directory removed right after each
    lookup that found a hit: a storage hit is read into host pages before it is reported
    (staged), so the pages gone are a shorter hit, never a failed request; outputs equal plain
    vLLM's. Checked failing with storage hits promised unstaged (the connector before: a read
    in the load, `reserve(stage=False)`): 3 of the 96 requests failed."""
    root = tmp_path / "kv"
    e = engine(model_dir, host_blocks=32, storage_dir=str(root))
    removed = _remove_pages_after_hits(e, root)
    sessions(e)
    stats = e.connector.core.stats
    assert not e.errors, f"{len(e.errors)} of {SESSIONS * TURNS} requests failed: {sorted(e.errors)}"
    assert e.outputs == plain_outputs
    assert sum(removed) > 0 and stats["stagings"] > 0 and stats["stagings_short"] > 0  # (the pages did vanish)
    assert stats["load_errors"] == stats["loads_short"] == stats["storage_reads_short"] == 0
    e.assert_drained()


@pytest.mark.parametrize("remove", [False, True], ids=["kept", "removed-after-each-hit"])
def test_two_instances_sharing_a_small_capped_directory_fail_no_request(model_dir, plain_outputs, tmp_path, remove):
    """Two instances on one storage directory under a `storage_cap_bytes` of 40 pages (each
    evicts the other's pages), every session's turns alternating between them, under vLLM's
    default `fail` policy (and, `removed-after-each-hit`, every page file removed right after each
    lookup that found a hit): no request fails, outputs equal plain vLLM's."""
    root = tmp_path / "kv"
    cap = 40 * (engine(model_dir, host_blocks=32).worker.page_bytes + 64)  # (a page file: page and trailer)
    pair = [FakeEngine(vllm_config(model_dir, connector="HiCacheConnector", failure_policy="fail",
                                   extra={"host_blocks": 32, "storage_dir": str(root), "storage_cap_bytes": cap}),
                       GPU_BLOCKS) for _ in range(2)]
    if remove:
        for e in pair:
            _remove_pages_after_hits(e, root)
    history = {s: list(SYSTEM) for s in range(SESSIONS)}
    for t in range(TURNS):
        for s in range(SESSIONS):
            history[s] += [(200 + 37 * s + 11 * t + i) % 990 + 10 for i in range(USER)]
            pair[(s + t) % 2].add(f"s{s}t{t}", history[s], REPLY)
        for e in pair:
            e.run()
        for s in range(SESSIONS):
            history[s] += pair[(s + t) % 2].outputs[f"s{s}t{t}"]
    for e in pair:
        assert not e.errors, f"{len(e.errors)} requests failed: {sorted(e.errors)}"
    assert pair[0].outputs | pair[1].outputs == plain_outputs
    if not remove:  # (the pages an instance wrote were served to the other, and evicted under the cap)
        assert sum(e.connector.core.stats["tokens_staged"] for e in pair) > 0
        assert sum(e.worker.stats()["storage"]["evicted_pages"] for e in pair) > 0
    for e in pair:
        assert e.connector.core.stats["load_errors"] == e.connector.core.stats["loads_short"] == 0
        e.assert_drained()


# -- storage that heals ---------------------------------------------------------------------------
def test_a_storage_directory_removed_mid_run_is_made_again_and_serves_within_5_s(model_dir, plain_outputs,
                                                                                 tmp_path):
    """`rm -rf` of the storage directory after two turns: the third turn's lookups miss, its first
    write makes the directory again, and what the scheduler side knew stored is written again; a
    fresh instance on the directory (nothing in its host tier) then loads the fourth turn's
    prompts from storage, within 5 s of the removal. No request fails, outputs equal plain
    vLLM's, the backend's counters show the heal. Checked failing with the file backend as it was
    (no `_heal`, no fan-out directory made again: the directory stayed gone, writes failed), and
    with the scheduler
    side trusting what it knew stored (`StorageTier.missing` as `_gone`: the fresh instance
    loaded nothing, its prompts' first pages never written again)."""
    root = tmp_path / "kv"
    a = engine(model_dir, host_blocks=32, storage_dir=str(root))
    history = sessions(a, range(2))
    shutil.rmtree(root)
    removed = time.monotonic()
    history = sessions(a, range(2, 3), history)
    assert not a.errors and a.worker.stats()["storage"]["dir_recreated"] == 1
    a.assert_drained()
    b = engine(model_dir, host_blocks=64, storage_dir=str(root))
    served: list[float] = []
    step = b.step

    def watched() -> None:
        step()
        if not served and b.connector.core.stats["tokens_storage_loaded"] > 0:
            served.append(time.monotonic())

    b.step = watched  # type: ignore[method-assign]
    sessions(b, range(3, 4), history)
    assert served and served[0] - removed < 5.0, "storage served nothing after the removal"
    assert not b.errors
    assert a.outputs | b.outputs == plain_outputs
    worker = a.worker.stats()["storage"]
    assert worker["health"] == "healthy" and worker["write_errors"] == 0
    b.assert_drained()


@pytest.mark.parametrize("level", ["WARNING", "ERROR"])
def test_a_read_only_directory_counts_write_failures_reads_keep_serving_one_line_in_vllms_log(
        model_dir, plain_outputs, tmp_path, monkeypatch, capsys, level):
    """Storage turned read-only after two turns: writes fail and are counted, the worker's
    backend is degraded (writes held back with backoff) while reads keep serving, no request
    fails, outputs equal plain vLLM's. The connector logs through vLLM's logger: with
    `VLLM_LOGGING_LEVEL=WARNING` exactly one line for the health change (not one per write), with
    `ERROR` none."""
    from vllm.logger import _configure_vllm_root_logger

    from tests.unit.storage.test_file_backend_healing import read_only

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", level)
    monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
    _configure_vllm_root_logger()  # (as vLLM does at import, from the environment)
    try:
        root = tmp_path / "kv"
        e = engine(model_dir, host_blocks=32, storage_dir=str(root))
        history = sessions(e, range(2))
        loaded = e.connector.core.stats["tokens_storage_loaded"]
        capsys.readouterr()
        with read_only(root, monkeypatch):
            sessions(e, range(2, TURNS), history)
        out = capsys.readouterr().out
    finally:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
        _configure_vllm_root_logger()
    assert not e.errors and e.outputs == plain_outputs
    assert e.connector.core.stats["tokens_storage_loaded"] > loaded  # reads kept serving
    worker = e.worker.stats()
    assert worker["storage_write_failures"] > 0 and worker["storage"]["health"] == "degraded"
    assert worker["storage"]["write_failures"] >= 3 and worker["storage"]["write_skipped"] > 0
    lines = [line for line in out.splitlines() if "HiCache storage" in line]
    if level == "WARNING":
        assert len(lines) == 1 and "healthy -> degraded" in lines[0], out
    else:
        assert not lines, out
    e.assert_drained()


# -- vLLM's own metrics ---------------------------------------------------------------------------
def test_vllms_stat_loggers_receive_the_tiers_hits_bytes_failures_and_storage_health(model_dir, tmp_path):
    """The connector's stats as vLLM hands them to its stat loggers (`SchedulerStats.
    kv_connector_stats`: the workers' merged by vLLM's `KVOutputAggregator`, the scheduler
    side's added by vLLM's scheduler), observed by vLLM's Prometheus connector metrics
    (`KVConnectorProm`, on a private registry) and its periodic log (`KVConnectorLogging`): the
    tiers' hit tokens, bytes loaded and stored per tier, cut hits and storage health equal the
    connector's own counters, and vLLM's prefix-cache hits by source split them by tier. Checked
    failing with `get_kv_connector_stats` returning None (what it did): no series."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    e = engine(model_dir, host_blocks=64, storage_dir=str(tmp_path / "kv"))
    sessions(e)
    registry = CollectorRegistry()

    class Prom(KVConnectorProm):  # (vLLM's, on a registry of the test's own)
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    prom = Prom(e.config, ["model_name", "engine"], {0: ["tiny", "0"]})
    logging = KVConnectorLogging(e.config.kv_transfer_config)
    assert e.connector_stats, "vLLM received no connector stats"
    for data in e.connector_stats:
        prom.observe(data, 0)
        logging.observe(data)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))

    def value(name: str, **labels: str) -> float:
        got = registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})
        assert got is not None, f"no series {name} {labels}"
        return got

    s, w = e.connector.core.stats, e.worker.stats()
    # (how a run splits its hits between the tiers depends on the worker's timing: either may be 0)
    assert value("vllm:hicache_hit_tokens_total", tier="host") == s["tokens_loaded"] - s["tokens_storage_loaded"]
    assert value("vllm:hicache_hit_tokens_total", tier="storage") == s["tokens_storage_loaded"] > 0
    assert value("vllm:hicache_loaded_bytes_total", tier="host") == w["loaded_bytes"] > 0  # (every load)
    assert value("vllm:hicache_loaded_bytes_total", tier="storage") == w["storage_read_bytes"] > 0
    assert value("vllm:hicache_stored_bytes_total", tier="host") == w["stored_bytes"] > 0
    assert value("vllm:hicache_stored_bytes_total", tier="storage") == w["storage_written_bytes"] > 0
    assert value("vllm:hicache_hits_cut_total") == s["hits_cut"]
    assert value("vllm:hicache_load_failures_total") == 0
    assert value("vllm:hicache_storage_health", side="worker") == 0
    page = e.worker.page_bytes
    assert w["loaded_bytes"] == s["tokens_loaded"] // 16 * page  # (every loaded block, whole)
    assert len(lines) == 1 and "KV Transfer metrics" in lines[0] and "storage_hit_tokens=" in lines[0]
    # vLLM's own prefix-cache hits by source (its `prompt_tokens_cached_by_source` counter) split
    # the same tokens by tier (vLLM counts a preempted request's hits apart: none on this trace)
    split = {"host": s["tokens_loaded"] - s["tokens_storage_loaded"], "disk": s["tokens_storage_loaded"]}
    assert e.preemptions or e.hits_by_source == {k: n for k, n in split.items() if n}


def test_pages_refused_by_their_integrity_tag_are_a_miss_counted_in_vllms_metrics(model_dir, plain_outputs,
                                                                                  tmp_path, monkeypatch):
    """A writes its pages under one storage key, B (a fresh instance on the same directory) reads
    them under another: every page B stages fails its MAC, is refused and counted in vLLM's
    metrics (`storage_pages_refused`), and is a miss: no request fails, outputs equal plain
    vLLM's."""
    root = str(tmp_path / "kv")
    monkeypatch.setenv("HICACHE_STORAGE_KEY", "writer-key-" + "a" * 16)
    a = engine(model_dir, host_blocks=32, storage_dir=root)
    sessions(a, range(1))
    monkeypatch.setenv("HICACHE_STORAGE_KEY", "reader-key-" + "b" * 16)
    b = engine(model_dir, host_blocks=32, storage_dir=root)
    sessions(b, range(1))
    refused = sum(data["counters"].get("storage_pages_refused", 0) for data in b.connector_stats)
    assert refused > 0 and refused == b.worker.stats()["storage_pages_refused"]
    assert b.connector.core.stats["tokens_staged"] == 0 and b.connector.core.stats["stagings"] > 0
    assert not b.errors and b.outputs == {rid: out for rid, out in plain_outputs.items() if rid.endswith("t0")}
    b.assert_drained()
