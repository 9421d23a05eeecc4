"""`stats()`: nested by tier and concern, every counter of every actor in it, latency histograms."""

from __future__ import annotations

from runtime.actors.base import Reply
from runtime.messages import OffloadStats, TransferStats, TreeStats
from runtime.runtime import CacheRuntime
from runtime.stats import GROUPS, LATENCY_BUCKETS_S, STATS, LatencyHistogram, Source
from tests.integration.support import quiescent_check, settle, small_config, toks
from tests.integration.test_lifecycle import serve


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    h = LatencyHistogram()
    for v in (0.0, LATENCY_BUCKETS_S[0], LATENCY_BUCKETS_S[0] * 1.01, 0.003, 99.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap["count"] == 5 and abs(snap["sum_seconds"] - (0.0001 + 0.000101 + 0.003 + 99.0)) < 1e-9
    b = snap["buckets"]
    assert list(b) == [*(repr(x) for x in LATENCY_BUCKETS_S), "+Inf"]
    assert (b["0.0001"], b["0.00025"], b["0.0025"], b["0.005"], b["10.0"], b["+Inf"]) == (2, 3, 3, 4, 4, 5)
    snap["buckets"]["+Inf"] = 0  # a snapshot is the caller's copy
    assert h.snapshot()["buckets"]["+Inf"] == 5


async def test_every_actor_counter_is_in_stats(tmp_path):
    """Nothing dropped: the table names exactly the counters each actor keeps (all features on)."""
    cfg = small_config(storage_backend="file", storage_dir=str(tmp_path), decode_offload=True)
    async with CacheRuntime.open(cfg) as rt:
        flat = {Source.TREE: await rt._sup.ask(rt._tree.mailbox, TreeStats(Reply())),
                Source.TRANSFER: await rt._sup.ask(rt._transfer.mailbox, TransferStats(Reply())),
                Source.OFFLOAD: await rt._sup.ask(rt._offload.mailbox, OffloadStats(Reply()))}
        for source, values in flat.items():
            assert {s.field for s in STATS if s.source is source} == set(values), source
        st = await rt.stats()
    assert tuple(st) == GROUPS
    assert sum(len(g) for g in st.values()) == len(STATS)


async def test_host_load_back_and_storage_fill_the_histograms(tmp_path):
    cfg = small_config(device_slots=128, host_tokens=512, storage_backend="file", storage_dir=str(tmp_path))
    async with CacheRuntime.open(cfg) as rt:
        prompts = [toks(60, 10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await serve(rt, f"r{i}", p)
            await settle(rt)
        again = await serve(rt, "again", prompts[0])
        await settle(rt)
        st = await rt.stats()
        await quiescent_check(rt)
    x, s = st["transfer"], st["storage"]
    assert again["loaded_host"] > 0 and st["host"]["hit_tokens"] == again["loaded_host"]
    assert x["load_seconds"]["count"] >= 1 and x["backup_seconds"]["count"] >= 1
    # every completed or failed copy is observed once, in its direction
    assert x["load_seconds"]["count"] + x["backup_seconds"]["count"] == x["ops_done"] + x["ops_failed"]
    assert x["load_seconds"]["sum_seconds"] > 0
    assert s["write_seconds"]["count"] == s["writes_issued"] >= 1 and s["written_pages"] > 0
    assert s["write_seconds"]["count"] + s["read_seconds"]["count"] + s["lookup_seconds"]["count"] == \
        s["ops_done"] + s["errors"] + s["backend_errors"]
    assert st["requests"]["hit_rate"] == (st["device"]["hit_rate"] + st["host"]["hit_rate"]) > 0


def test_docs_name_every_stat_and_metric():
    from pathlib import Path

    from runtime.metrics import FAMILIES

    doc = (Path(__file__).parents[2] / "docs" / "API.md").read_text()
    for s in STATS:
        assert f"| `{s.key}` |" in doc and f"**`{s.group}`**" in doc, (s.group, s.key)
    for f in FAMILIES:
        assert f"| `{f.name}" in doc, f.name
