"""Prometheus metrics: a /metrics scrape equals stats(); registries isolated; endpoint lifecycle."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from runtime.errors import ConfigError, StateError
from runtime.metrics import FAMILIES
from runtime.runtime import CacheRuntime
from runtime.stats import STATS, Kind
from tests.integration.support import small_config, toks
from tests.integration.test_lifecycle import serve
from tests.integration.test_storage_tier import quiescent, readmit_ok, settle_all


def scrape(port: int) -> str:
    """A blocking GET. Called on the loop thread on purpose: a collector that needed the loop
    (asked an actor) would deadlock here and time out."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def expected(snapshot: dict) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples the table says a snapshot exports (counters as <name>_total)."""
    out = {}
    for s in STATS:
        if s.metric is None:
            continue
        value, labels = snapshot[s.group][s.key], dict(s.labels)
        if s.kind is Kind.COUNTER:
            out[(s.metric + "_total", tuple(sorted(labels.items())))] = value
        elif s.kind is Kind.GAUGE:
            out[(s.metric, tuple(sorted(labels.items())))] = value
        else:
            for le, n in value["buckets"].items():
                out[(s.metric + "_bucket", tuple(sorted({**labels, "le": le}.items())))] = n
            out[(s.metric + "_count", tuple(sorted(labels.items())))] = value["count"]
            out[(s.metric + "_sum", tuple(sorted(labels.items())))] = value["sum_seconds"]
    return out


def hicache_names(registry: CollectorRegistry) -> set[str]:
    return {m.name for m in registry.collect() if m.name.startswith("hicache_")}


async def test_scrape_equals_stats_after_hits_load_backs_and_storage(tmp_path):
    cfg = small_config(copy_engine="cpu", device_slots=128, host_tokens=512, storage_backend="file",
                       storage_dir=str(tmp_path), metrics_port=0, metrics_interval_s=3600)
    registry = CollectorRegistry()
    async with CacheRuntime.open(cfg, metrics_registry=registry) as rt:
        endpoint = rt._metrics.endpoint
        assert endpoint is not None and endpoint._server.server_address[0] == "127.0.0.1"
        prompts = [toks(60, 10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await serve(rt, f"r{i}", p)
            await settle_all(rt)
        await serve(rt, "again", prompts[0])                    # evicted from device: a host load-back
        await serve(rt, "hit", prompts[3])                      # still on device: a device hit
        await settle_all(rt)
        assert await rt.flush() > 0
        assert await readmit_ok(rt, "stored", prompts[0]) > 0  # back from the storage files
        await quiescent(rt)
        snap = await rt.refresh_metrics()
        text = scrape(rt.metrics_port)
        st = await rt.stats()
    got = samples(text)
    assert got == expected(snap)  # every sample, nothing more
    assert {f.name for f in FAMILIES} == {fam.name for fam in text_string_to_metric_families(text)}
    # the workload reached every tier, the copy engine and the storage backend
    assert snap["device"]["hit_tokens"] > 0 and snap["host"]["hit_tokens"] > 0 and snap["storage"]["hit_tokens"] > 0
    assert snap["transfer"]["load_seconds"]["count"] > 0 and snap["storage"]["read_seconds"]["count"] > 0
    assert snap["storage"]["written_bytes"] > 0 and snap["device"]["evicted_tokens"] > 0
    # quiescent: the scraped counters and histograms are stats() now, value for value
    for s in STATS:
        if s.kind in (Kind.COUNTER, Kind.HISTOGRAM):
            assert st[s.group][s.key] == snap[s.group][s.key], (s.group, s.key)
    assert got[("hicache_hit_tokens_total", (("tier", "host"),))] == st["host"]["hit_tokens"]
    assert got[("hicache_transferred_bytes_total", (("direction", "host_to_device"),))] == \
        st["transfer"]["host_to_device_bytes"] > 0


async def test_snapshot_refreshes_by_itself():
    registry = CollectorRegistry()
    async with CacheRuntime.open(small_config(metrics_interval_s=0.02), metrics_registry=registry) as rt:
        def admitted() -> float | None:
            return registry.get_sample_value("hicache_requests_admitted_total")

        assert admitted() == 0  # the first snapshot is taken at open
        await serve(rt, "a", toks(20, 1))
        for _ in range(250):
            if admitted() == 1:
                break
            await asyncio.sleep(0.02)
        assert admitted() == 1


async def test_two_runtimes_two_registries_nothing_global():
    before = set(REGISTRY._names_to_collectors)
    one, two = CollectorRegistry(), CollectorRegistry()
    async with CacheRuntime.open(small_config(), metrics_registry=one) as a, \
            CacheRuntime.open(small_config(), metrics_registry=two) as b:
        await serve(a, "x", toks(20, 1))
        await serve(a, "y", toks(20, 2))
        await serve(b, "z", toks(20, 3))
        await a.refresh_metrics()
        await b.refresh_metrics()
        assert one.get_sample_value("hicache_requests_finished_total") == 2
        assert two.get_sample_value("hicache_requests_finished_total") == 1
        # a registry that has them already is refused at open, before anything starts
        with pytest.raises(ConfigError, match="metrics_registry"):
            async with CacheRuntime.open(small_config(), metrics_registry=one):
                pass
        assert one.get_sample_value("hicache_requests_finished_total") == 2  # a's untouched
    assert set(REGISTRY._names_to_collectors) == before
    assert b"hicache_" not in generate_latest(REGISTRY)
    assert hicache_names(one) == hicache_names(two) == set()  # unregistered at close


async def test_endpoint_stops_on_close():
    async with CacheRuntime.open(small_config(metrics_port=0)) as rt:
        port = rt.metrics_port
        assert port and "hicache_live_requests 0.0" in scrape(port)
        assert hicache_names(rt.metrics_registry)
    assert rt.metrics_port is None
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(port)


async def test_metrics_off_touches_no_registry():
    before = set(REGISTRY._names_to_collectors)
    async with CacheRuntime.open(small_config()) as rt:
        await serve(rt, "a", toks(20, 1))
        assert rt.metrics_registry is None and rt.metrics_port is None
        with pytest.raises(StateError):
            await rt.refresh_metrics()
        assert (await rt.stats())["requests"]["finished"] == 1
    assert set(REGISTRY._names_to_collectors) == before


@pytest.mark.parametrize("field,value", [("metrics_port", -1), ("metrics_port", 65536), ("metrics_port", True),
                                         ("metrics_port", "9400"), ("metrics_addr", ""), ("metrics_addr", None),
                                         ("metrics_interval_s", 0), ("metrics_interval_s", float("inf")),
                                         ("metrics_interval_s", True)])
def test_config_refuses_bad_metrics_fields(field, value):
    with pytest.raises(ConfigError, match=field):
        small_config(**{field: value})


async def test_open_refuses_a_registry_that_is_not_one():
    with pytest.raises(ConfigError, match="CollectorRegistry"):
        async with CacheRuntime.open(small_config(), metrics_registry={}):
            pass


def counter_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The scrape's counter and histogram count/sum samples (the values that must only grow)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("counter", "histogram"):
            for s in fam.samples:
                if fam.type == "counter" or s.name.endswith(("_count", "_sum", "_bucket")):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_counters_only_grow_across_detach_and_attach(tmp_path):
    """Storage traffic, `detach_storage`, `attach_storage` of a new backend on the same directory,
    more traffic: no counter of stats() and no counter sample of a /metrics scrape ever decreases,
    and the storage counters go on from where they were. Checked failing with the counters kept in
    the replaceable `StorageTier` (written_pages 10 -> 0 after the attach)."""
    from runtime.storage.file_backend import FileBackend

    cfg = small_config(copy_engine="cpu", device_slots=128, host_tokens=512, metrics_port=0, metrics_interval_s=3600,
                       prefetch_policy="wait_complete")
    page_bytes = cfg.page_size * cfg.bytes_per_token
    first, second = FileBackend(tmp_path, page_bytes), FileBackend(tmp_path, page_bytes)
    snaps, scrapes = [], []
    try:
        async with CacheRuntime.open(cfg, storage=first, metrics_registry=CollectorRegistry()) as rt:
            async def look() -> None:
                await quiescent(rt)
                snaps.append(await rt.refresh_metrics())
                scrapes.append(counter_samples(scrape(rt.metrics_port)))

            a, b = toks(41, 31), toks(41, 32)
            await serve(rt, "a", a)
            await settle_all(rt)  # written through: the flush drops the host copies
            await rt.flush()
            assert await readmit_ok(rt, "a2", a) > 0  # a storage read
            await look()
            await rt.detach_storage()
            await look()
            await rt.attach_storage(second)
            await look()
            await serve(rt, "b", b)
            await settle_all(rt)
            await rt.flush()
            assert await readmit_ok(rt, "b2", b) > 0
            await look()
    finally:
        first.close()
        second.close()
    storage = [s["storage"] for s in snaps]
    assert storage[0]["written_pages"] > 0 and storage[0]["read_pages"] > 0 and storage[0]["lookups_issued"] > 0
    assert storage[2]["written_pages"] == storage[0]["written_pages"]  # kept across the detach/attach
    assert storage[3]["written_pages"] > storage[2]["written_pages"]
    for before, after in zip(snaps, snaps[1:]):
        for s in STATS:
            if s.kind is Kind.COUNTER:
                assert after[s.group][s.key] >= before[s.group][s.key], (s.group, s.key, before, after)
            elif s.kind is Kind.HISTOGRAM:
                assert after[s.group][s.key]["count"] >= before[s.group][s.key]["count"], (s.group, s.key)
    for before, after in zip(scrapes, scrapes[1:]):
        assert set(before) <= set(after)
        assert [k for k, v in before.items() if after[k] < v] == []
