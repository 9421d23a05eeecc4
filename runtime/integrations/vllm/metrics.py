"""The connector's stats in vLLM's own metrics path (vLLM 0.33's `KVConnectorStats`).

Each side reports, per step, what changed since its last report: the scheduler side the tokens
its tiers served and backed up, the hits it cut and the loads that failed; each worker the bytes
it copied and moved to and from storage, the storage writes that failed and the pages read
from storage it refused (their integrity tags failed); both their storage
backend's health (a gauge per side). vLLM merges the workers' stats (`aggregate`), adds the
scheduler side's, and hands the merged data to its stat loggers: the periodic "KV Transfer
metrics" log line (`reduce`) and its Prometheus logger (`HiCachePromMetrics.observe`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

__all__ = ["HiCacheConnectorStats", "HiCachePromMetrics", "Deltas", "METRICS", "report"]


@dataclass(frozen=True)
class Metric:
    name: str  # the Prometheus metric (counters get prometheus_client's "_total" suffix)
    labels: dict[str, str]  # its own labels' values for this stats key
    doc: str


# stats key -> its Prometheus series; "gauges" are set, the rest are counters
METRICS: dict[str, Metric] = {
    "host_hit_tokens": Metric("vllm:hicache_hit_tokens", {"tier": "host"}, "Prompt tokens loaded from a tier."),
    "storage_hit_tokens": Metric("vllm:hicache_hit_tokens", {"tier": "storage"}, ""),
    "hits_cut": Metric("vllm:hicache_hits_cut", {}, "Hits cut at their report to the host room their load could have."),
    "hit_tokens_cut": Metric("vllm:hicache_hit_tokens_cut", {}, "Tokens of hits cut at their report."),
    "backed_up_tokens": Metric("vllm:hicache_backed_up_tokens", {}, "Tokens backed up from GPU blocks to the host tier."),
    "load_failures": Metric("vllm:hicache_load_failures", {}, "Loads that left blocks unfilled (vLLM recomputes "
                                                              "or fails them by its kv_load_failure_policy)."),
    "backup_failures": Metric("vllm:hicache_backup_failures", {}, "Backups to the host tier that failed."),
    "storage_lookup_failures": Metric("vllm:hicache_storage_lookup_failures", {}, "Storage lookups that failed."),
    "loaded_bytes": Metric("vllm:hicache_loaded_bytes", {"tier": "host"}, "Bytes loaded into GPU blocks from the "
                                                                          "host tier, and into it from storage."),
    "storage_read_bytes": Metric("vllm:hicache_loaded_bytes", {"tier": "storage"}, ""),
    "stored_bytes": Metric("vllm:hicache_stored_bytes", {"tier": "host"}, "Bytes stored from GPU blocks to the host "
                                                                          "tier, and from it to storage."),
    "storage_written_bytes": Metric("vllm:hicache_stored_bytes", {"tier": "storage"}, ""),
    "storage_read_failures": Metric("vllm:hicache_storage_read_failures", {}, "Storage reads that failed."),
    "storage_pages_refused": Metric("vllm:hicache_storage_pages_refused", {},
                                    "Pages read from storage whose integrity tag failed (a wrong MAC or "
                                    "checksum): refused, their blocks recomputed."),
    "storage_write_failures": Metric("vllm:hicache_storage_write_failures", {}, "Pages storage failed to write."),
    "storage_health_scheduler": Metric("vllm:hicache_storage_health", {"side": "scheduler"},
                                       "Storage backend health: 0 healthy, 1 degraded, 2 down (worst worker)."),
    "storage_health_worker": Metric("vllm:hicache_storage_health", {"side": "worker"}, ""),
}
GAUGES = frozenset({"storage_health_scheduler", "storage_health_worker"})


class HiCacheConnectorStats(KVConnectorStats):
    """``data``: {"counters": {key: count since the last report}, "gauges": {key: value}}; merged
    by summing counters and keeping each gauge's worst (highest) value."""

    def __post_init__(self) -> None:
        self.data = {"counters": dict(self.data.get("counters", {})), "gauges": dict(self.data.get("gauges", {}))}

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters, gauges = self.data["counters"], self.data["gauges"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        for k, v in other.data.get("gauges", {}).items():
            gauges[k] = max(gauges.get(k, v), v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {**self.data["counters"], **self.data["gauges"]}

    def is_empty(self) -> bool:
        return not self.data["counters"] and not self.data["gauges"]


class Deltas:
    """Counters reported as what changed since the last report (thread-safe: a worker's jobs
    count on its threads, vLLM takes the report on its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()

    def add(self, **counts: int) -> None:
        with self._lock:
            self._new.update(counts)
            self.totals.update(counts)

    def take(self) -> dict[str, int]:
        with self._lock:
            new = {k: v for k, v in self._new.items() if v}
            self._new.clear()
        return new


def report(counters: dict[str, int], health_key: str, health: int | None,
           last_health: int | None) -> HiCacheConnectorStats | None:
    """One side's stats for a step: its counters, and its storage health whenever it reports
    anything, changed, or is not healthy (so that a healthy side's report never hides another's
    trouble in vLLM's merge); None when there is nothing to say."""
    gauges = {}
    if health is not None and (counters or health != last_health or health > 0):
        gauges[health_key] = health
    if not counters and not gauges:
        return None
    return HiCacheConnectorStats({"counters": counters, "gauges": gauges})


class HiCachePromMetrics(KVConnectorPromMetrics):
    """The connector's series on vLLM's Prometheus endpoint (`METRICS`), per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        families: dict[str, Any] = {}
        for key, m in METRICS.items():
            if m.name in families:
                continue
            own = sorted(m.labels)
            docs = next(x.doc for x in METRICS.values() if x.name == m.name and x.doc)
            if key in GAUGES:
                families[m.name] = self._gauge_cls(name=m.name, documentation=docs, labelnames=labelnames + own,
                                                   multiprocess_mode="mostrecent")
            else:
                families[m.name] = self._counter_cls(name=m.name, documentation=docs, labelnames=labelnames + own)
        self._series = {(engine, key): families[m.name].labels(*values, *(m.labels[k] for k in sorted(m.labels)))
                        for engine, values in per_engine_labelvalues.items() for key, m in METRICS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, v in transfer_stats_data.get("counters", {}).items():
            if key in METRICS and v:
                self._series[(engine_idx, key)].inc(v)
        for key, v in transfer_stats_data.get("gauges", {}).items():
            if key in METRICS:
                self._series[(engine_idx, key)].set(v)
