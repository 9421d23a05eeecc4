"""The `stats()` schema: every counter the actors keep, grouped by tier and concern.

Each actor keeps its own flat counters (the tree actor's core, the transfer actor, the offload
actor) and answers its stats message with a fresh flat dict. `nest` turns the three answers
into the nested dict that `CacheRuntime.stats()` returns, by one table (`STATS`), which also
names the Prometheus family and labels of each value (`runtime.metrics`): stats and metrics
are one source of truth. docs/API.md documents the same table.

Latency histograms are kept by the actor that completes the operation (`LatencyHistogram`,
fixed buckets, O(1) per observation) and travel in its stats answer as plain snapshots.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Upper bounds (seconds) of the latency buckets: a CPU copy of a page takes ~0.1 ms, a
# storage call from ~1 ms (local file) to seconds (an overdue remote store).
LATENCY_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)


def bucket_label(bound: float) -> str:
    """A bucket bound as Prometheus writes its `le` label ("0.005", "1.0", "+Inf")."""
    return "+Inf" if bound == math.inf else repr(float(bound))


_LABELS = tuple(bucket_label(b) for b in (*LATENCY_BUCKETS_S, math.inf))


class LatencyHistogram:
    """Counts of observed durations per bucket, their sum and count; owned by one actor."""

    __slots__ = ("counts", "sum_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # per bucket (not cumulative); the last is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def snapshot(self) -> dict[str, Any]:
        """{"count", "sum_seconds", "buckets": {le: cumulative count}} (a fresh dict)."""
        cum, buckets = 0, {}
        for label, n in zip(_LABELS, self.counts):
            cum += n
            buckets[label] = cum
        return {"count": cum, "sum_seconds": self.sum_s, "buckets": buckets}


class Kind(enum.Enum):
    COUNTER = "counter"      # only grows; exported as <metric>_total
    GAUGE = "gauge"          # a size or depth now
    HISTOGRAM = "histogram"  # a LatencyHistogram snapshot
    RATIO = "ratio"          # derived from counters; in stats() only (rate them in PromQL)


class Source(enum.Enum):
    TREE = "tree"
    TRANSFER = "transfer"
    OFFLOAD = "offload"


@dataclass(frozen=True, slots=True)
class Stat:
    """One value of `stats()[group][key]`: where it comes from and how it is exported."""

    group: str
    key: str
    source: Source | None  # None: derived (ratios)
    field: str             # the source actor's flat counter name
    kind: Kind
    help: str
    metric: str | None = None  # Prometheus family name (counters without `_total`); None: not exported
    labels: tuple[tuple[str, str], ...] = ()


T, X, O = Source.TREE, Source.TRANSFER, Source.OFFLOAD
C, G, H, R = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM, Kind.RATIO


def _s(group: str, key: str, source: Source | None, field: str, kind: Kind, help: str, metric: str | None = None,
       **labels: str) -> Stat:
    return Stat(group, key, source, field, kind, help, metric, tuple(labels.items()))


STATS: tuple[Stat, ...] = (
    # requests: admissions and the prompt tokens nobody had cached
    _s("requests", "admitted", T, "requests_admitted", C, "requests admitted", "hicache_requests_admitted"),
    _s("requests", "finished", T, "requests_finished", C, "requests finished", "hicache_requests_finished"),
    _s("requests", "aborted", T, "requests_aborted", C, "requests aborted (abort, a cancelled caller)",
       "hicache_requests_aborted"),
    _s("requests", "live", T, "live_requests", G, "requests admitted and not yet finished or aborted",
       "hicache_live_requests"),
    _s("requests", "recomputed_tokens", T, "tokens_recomputed", C, "prompt tokens no tier had at admit (computed)",
       "hicache_recomputed_tokens"),
    _s("requests", "hit_rate", None, "", R, "(device + host hit tokens) / all admitted prompt tokens"),
    # device tier
    _s("device", "hit_tokens", T, "tokens_device_hit", C, "prompt tokens found on device at admit",
       "hicache_hit_tokens", tier="device"),
    _s("device", "hit_rate", None, "", R, "device hit tokens / all admitted prompt tokens"),
    _s("device", "evicted_tokens", T, "device_evicted_tokens", C, "tokens evicted from the tier",
       "hicache_evicted_tokens", tier="device"),
    _s("device", "free_slots", T, "device_free_slots", G, "free slots (one slot holds one token's KV)",
       "hicache_free_slots", tier="device"),
    # host tier
    _s("host", "hit_tokens", T, "tokens_host_hit", C, "prompt tokens found in host memory at admit (loaded back; "
       "includes tokens a prefetch brought from storage)", "hicache_hit_tokens", tier="host"),
    _s("host", "hit_rate", None, "", R, "host hit tokens / all admitted prompt tokens"),
    _s("host", "hit_tokens_recomputed", T, "tokens_host_hit_recomputed", C, "host hit tokens an admission "
       "recomputed because loading them would have taken longer (reuse_cost 'measured')", "hicache_host_hit_tokens_recomputed"),
    _s("host", "evicted_tokens", T, "host_evicted_tokens", C, "tokens evicted from the tier",
       "hicache_evicted_tokens", tier="host"),
    _s("host", "free_slots", T, "host_free_slots", G, "free slots (one slot holds one token's KV)",
       "hicache_free_slots", tier="host"),
    # recurrent state (hybrid models): snapshots of the state after a node's last token
    _s("state", "snapshots_taken", T, "state_snapshots_taken", C, "state snapshots the engine was given a slot for",
       "hicache_state_snapshots_taken"),
    _s("state", "snapshots_kept", T, "state_snapshots_kept", C, "snapshots kept by the tree node ending at them",
       "hicache_state_snapshots_kept"),
    _s("state", "snapshots_evicted", T, "state_snapshots_evicted", C,
       "snapshots dropped for a state slot (their nodes kept their KV)", "hicache_state_snapshots_evicted"),
    _s("state", "hits", T, "state_hits", C, "admissions that resumed from a snapshot", "hicache_state_hits"),
    _s("state", "free_slots", T, "state_free_slots", G, "free device state slots", "hicache_state_free_slots"),
    _s("state", "storage_writes", T, "state_storage_writes", C, "host snapshots written to storage with their "
       "node's KV (every chunk stored)", "hicache_state_storage_writes"),
    _s("state", "storage_write_failures", T, "state_storage_write_failures", C,
       "host snapshots whose storage write failed (a chunk not stored)", "hicache_state_storage_write_failures"),
    _s("state", "storage_hits", T, "state_storage_hits", C, "snapshots a prefetch read from storage and a node "
       "adopted (its hit's usable end)", "hicache_state_storage_hits"),
    _s("state", "storage_misses", T, "state_storage_misses", C, "prefetches whose KV was found in storage with no "
       "whole snapshot at any of its boundaries, or whose snapshot read failed (no hit)",
       "hicache_state_storage_misses"),
    # sliding-window layers: their own device pool, whose pages outside every window drop
    _s("swa", "pages_dropped", T, "swa_pages_dropped", C,
       "sliding-layer pages given back outside every node end's window (their full KV kept)",
       "hicache_swa_pages_dropped"),
    _s("swa", "cut_backs", T, "swa_cut_backs", C, "admissions whose hit was cut back to a present window",
       "hicache_swa_cut_backs"),
    _s("swa", "cut_tokens", T, "swa_cut_tokens", C, "matched tokens admissions did not use for a dropped window",
       "hicache_swa_cut_tokens"),
    _s("swa", "free_slots", T, "swa_free_slots", G, "free slots of the sliding layers' device pool",
       "hicache_swa_free_slots"),
    # the tree actor's device <-> host copies
    _s("copies", "backups_issued", T, "backups_issued", C, "device -> host backups issued",
       "hicache_copies_issued", direction="device_to_host"),
    _s("copies", "loads_issued", T, "loads_issued", C, "host -> device loads issued",
       "hicache_copies_issued", direction="host_to_device"),
    _s("copies", "failures", T, "copy_failures", C, "backups and loads acked as failed (rolled back)",
       "hicache_copy_failures"),
    _s("copies", "writeback_deferred_tokens", T, "writeback_deferred", C,
       "write-back: tokens whose device eviction waited for their backup", "hicache_writeback_deferred_tokens"),
    _s("copies", "inflight", T, "inflight_copies", G, "copies issued and not acked (backups, loads, offloads)",
       "hicache_inflight_copies"),
    # the transfer actor: what the copy engine ran
    _s("transfer", "ops_done", X, "ops_done", C, "copies completed", "hicache_transfer_ops", outcome="done"),
    _s("transfer", "ops_failed", X, "ops_failed", C, "copies failed (engine error)", "hicache_transfer_ops",
       outcome="failed"),
    _s("transfer", "device_to_host_bytes", X, "bytes_device_to_host", C,
       "bytes moved by completed copies (every tensor-parallel rank's)", "hicache_transferred_bytes",
       direction="device_to_host"),
    _s("transfer", "host_to_device_bytes", X, "bytes_host_to_device", C,
       "bytes moved by completed copies (every tensor-parallel rank's)", "hicache_transferred_bytes",
       direction="host_to_device"),
    _s("transfer", "inflight_loads", X, "inflight_loads", G, "loads running in the copy engine",
       "hicache_transfer_running", direction="host_to_device"),
    _s("transfer", "inflight_backups", X, "inflight_backups", G, "backups running in the copy engine",
       "hicache_transfer_running", direction="device_to_host"),
    _s("transfer", "load_seconds", X, "load_seconds", H, "copy time, engine start to completion",
       "hicache_copy_duration_seconds", direction="host_to_device"),
    _s("transfer", "backup_seconds", X, "backup_seconds", H, "copy time, engine start to completion",
       "hicache_copy_duration_seconds", direction="device_to_host"),
    # storage tier: the tree's view (what it issued, what landed) ...
    _s("storage", "hit_tokens", T, "tokens_storage_hit", C, "tokens prefetches read from storage into the tree "
       "(admitted later as host hits)", "hicache_storage_hit_tokens"),
    _s("storage", "writes_issued", T, "storage_writes_issued", C, "write ops issued (after host backups)",
       "hicache_storage_ops_issued", op="write"),
    _s("storage", "lookups_issued", T, "storage_lookups_issued", C, "prefetch lookups issued (existence only)",
       "hicache_storage_ops_issued", op="lookup"),
    _s("storage", "reads_issued", T, "storage_reads_issued", C, "prefetch reads issued",
       "hicache_storage_ops_issued", op="read"),
    _s("storage", "written_pages", T, "storage_pages_written", C, "pages stored", "hicache_storage_written_pages"),
    _s("storage", "write_failed_pages", T, "storage_write_failures", C,
       "pages not stored (error or backend refusal; never marked stored)", "hicache_storage_write_failed_pages"),
    _s("storage", "read_pages", T, "storage_pages_read", C, "pages read into host memory",
       "hicache_storage_read_pages"),
    _s("storage", "read_missed_pages", T, "storage_read_misses", C, "pages looked up or read but missing",
       "hicache_storage_read_missed_pages"),
    _s("storage", "read_failures", T, "storage_read_failures", C, "lookups and reads that failed (a miss)",
       "hicache_storage_read_failures"),
    _s("storage", "prefetches_skipped", T, "prefetch_skipped", C, "prefetch reads not started (host full)",
       "hicache_prefetches_skipped"),
    _s("storage", "prefetches_aborted", T, "prefetch_aborted", C, "prefetches cancelled by abort",
       "hicache_prefetches_aborted"),
    _s("storage", "writes_skipped", T, "storage_writes_skipped", C, "write-throughs the transfer actor did not make "
       "(ops_skipped); while the backend is down none is issued", "hicache_storage_writes_skipped"),
    _s("storage", "inflight", T, "inflight_storage_ops", G, "storage ops issued and not acked",
       "hicache_inflight_storage_ops"),
    # ... and the transfer actor's backend calls
    _s("storage", "ops_done", X, "storage_ops_done", C, "backend calls that returned", "hicache_storage_ops",
       outcome="done"),
    _s("storage", "errors", X, "storage_errors", C, "backend calls that raised", "hicache_storage_ops",
       outcome="error"),
    _s("storage", "backend_errors", X, "storage_backend_errors", C,
       "backend calls that returned a value outside the contract (a miss)", "hicache_storage_ops",
       outcome="contract_violation"),
    _s("storage", "ops_failed", X, "storage_ops_failed", C, "errors + backend_errors"),
    _s("storage", "rejected_pages", X, "storage_pages_rejected", C,
       "pages read whose tag did not check out against the bytes in the host pool (corrupt, or written "
       "without the storage key): misses, never served", "hicache_storage_rejected_pages"),
    _s("storage", "ops_overdue", X, "storage_ops_overdue", C, "backend calls that outlived storage_timeout_s",
       "hicache_storage_ops_overdue"),
    _s("storage", "ops_submitted", X, "storage_ops_submitted", C, "storage ops handed to the transfer actor",
       "hicache_storage_ops_submitted"),
    _s("storage", "ops_abandoned", X, "storage_ops_abandoned", C,
       "storage ops still in flight when the runtime stopped (nobody acked; their calls may still return)",
       "hicache_storage_ops", outcome="abandoned"),
    _s("storage", "written_bytes", X, "storage_bytes_written", C,
       "bytes written by completed calls (every rank's pages and state chunks)",
       "hicache_transferred_bytes", direction="host_to_storage"),
    _s("storage", "read_bytes", X, "storage_bytes_read", C,
       "bytes read by completed calls (every rank's pages and state chunks)",
       "hicache_transferred_bytes", direction="storage_to_host"),
    _s("storage", "calls_running", X, "storage_calls_running", G, "backend calls in worker threads (overdue included)",
       "hicache_storage_calls_running"),
    _s("storage", "calls_waiting", X, "storage_calls_waiting", G,
       "storage ops waiting for a call to start (storage_max_inflight_ops running)", "hicache_storage_calls_waiting"),
    _s("storage", "ops_skipped", X, "storage_ops_skipped", C, "storage ops not made: the backend down (no probe "
       "due), overdue ops holding storage_max_overdue_pages, or still waiting at their deadline",
       "hicache_storage_ops", outcome="skipped"),
    _s("storage", "probes", X, "storage_probes", C, "lookups probing a down backend (in ops_submitted too)",
       "hicache_storage_probes"),
    _s("storage", "health", X, "health", G, "the backend's health: healthy, degraded (a channel failing) or down"),
    _s("storage", "health_level", X, "health_level", G, "the backend's health: 0 healthy, 1 degraded, 2 down",
       "hicache_storage_health"),
    _s("storage", "health_seconds", X, "health_seconds", G, "seconds since the health last changed",
       "hicache_storage_health_seconds"),
    _s("storage", "health_changes", X, "health_changes", C, "changes of the backend's health",
       "hicache_storage_health_changes"),
    _s("storage", "overdue_ops", X, "storage_overdue_ops", G, "overdue calls that have not returned",
       "hicache_storage_overdue_ops"),
    _s("storage", "overdue_host_pages", X, "storage_overdue_host_pages", G,
       "host pages overdue reads and writes hold until their calls return", "hicache_storage_overdue_host_pages"),
    _s("storage", "overdue_host_bytes", X, "storage_overdue_host_bytes", G,
       "bytes of those pages (every rank's)", "hicache_storage_overdue_host_bytes"),
    _s("storage", "write_seconds", X, "storage_write_seconds", H, "backend call time, submit to return",
       "hicache_storage_op_duration_seconds", op="write"),
    _s("storage", "read_seconds", X, "storage_read_seconds", H, "backend call time, submit to return",
       "hicache_storage_op_duration_seconds", op="read"),
    _s("storage", "lookup_seconds", X, "storage_lookup_seconds", H, "backend call time, submit to return",
       "hicache_storage_op_duration_seconds", op="lookup"),
    # decode offload (config decode_offload): the tree's side ...
    _s("offload", "issued", T, "offloads_issued", C, "offload chunks issued (device -> host)",
       "hicache_offloads_issued"),
    _s("offload", "skipped", T, "offloads_skipped", C, "offload chunks not issued (host full)",
       "hicache_offloads_skipped"),
    _s("offload", "offloaded_tokens", T, "offloaded_tokens", C, "tokens in issued offload chunks",
       "hicache_offloaded_tokens"),
    _s("offload", "copy_failures", T, "offload_copy_failures", C, "offload copies acked as failed",
       "hicache_offload_copy_failures"),
    _s("offload", "releases", T, "offload_releases", C, "requests whose device slots were freed after offload",
       "hicache_offload_releases"),
    _s("offload", "host_kept_tokens", T, "offload_host_tokens_kept", C, "offloaded tokens kept in the tree",
       "hicache_offload_host_kept_tokens"),
    _s("offload", "inflight", T, "inflight_offloads", G, "offload copies not acked",
       "hicache_inflight_offloads"),
    _s("offload", "retired_requests", T, "offload_retired_requests", G,
       "finished requests waiting for their offloads", "hicache_offload_retired_requests"),
    # ... and the offload actor's
    _s("offload", "started", O, "offloads_started", C, "offloads the offload actor started",
       "hicache_offload_actor_offloads", outcome="started"),
    _s("offload", "not_started", O, "offloads_not_started", C, "offloads the tree refused (host full, gone)",
       "hicache_offload_actor_offloads", outcome="not_started"),
    _s("offload", "landed", O, "offloads_landed", C, "offloads acked ok",
       "hicache_offload_actor_offloads", outcome="landed"),
    _s("offload", "failed", O, "offloads_failed", C, "offloads acked failed",
       "hicache_offload_actor_offloads", outcome="failed"),
    _s("offload", "releases_sent", O, "offload_releases_sent", C, "releases sent to the tree actor",
       "hicache_offload_releases_sent"),
    _s("offload", "tracked_requests", O, "offload_tracked_requests", G, "requests with offload state",
       "hicache_offload_tracked_requests"),
    _s("offload", "actor_inflight", O, "offload_inflight_ops", G, "offloads in flight (the offload actor's count)",
       "hicache_offload_actor_inflight"),
    # queues: mailboxes and copies waiting for an engine slot
    _s("queues", "tree_mailbox_messages", T, "tree_mailbox_depth", G, "messages waiting in the actor's mailbox",
       "hicache_mailbox_messages", actor="tree"),
    _s("queues", "transfer_mailbox_messages", X, "mailbox_depth", G, "messages waiting in the actor's mailbox",
       "hicache_mailbox_messages", actor="transfer"),
    _s("queues", "offload_mailbox_messages", O, "offload_mailbox_depth", G, "messages waiting in the actor's mailbox",
       "hicache_mailbox_messages", actor="offload"),
    _s("queues", "waiting_loads", X, "queued_loads", G, "loads waiting for a copy-engine slot",
       "hicache_transfer_waiting", direction="host_to_device"),
    _s("queues", "waiting_backups", X, "queued_backups", G, "backups waiting for a copy-engine slot",
       "hicache_transfer_waiting", direction="device_to_host"),
    # the tree
    _s("tree", "nodes", T, "tree_nodes", G, "radix-tree nodes", "hicache_tree_nodes"),
    # KV cache events (config kv_events; docs/EVENTS.md)
    _s("events", "recorded", T, "kv_events_recorded", C, "events recorded (BlockStored, BlockRemoved, AllBlocksCleared)",
       "hicache_kv_events"),
    _s("events", "batches", T, "kv_event_batches", C, "event batches published (one per tree-actor turn with events)",
       "hicache_kv_event_batches"),
    _s("events", "dropped_batches", T, "kv_event_batches_dropped", C,
       "batches the ZMQ publisher's queue refused (its thread fell behind)", "hicache_kv_event_batches_dropped"),
)

GROUPS: tuple[str, ...] = tuple(dict.fromkeys(s.group for s in STATS))


def nest(tree: Mapping[str, Any], transfer: Mapping[str, Any], offload: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The nested `stats()` dict from the three actors' flat answers (a KeyError names a counter
    an actor stopped keeping: the table and the actors must agree)."""
    sources = {Source.TREE: tree, Source.TRANSFER: transfer, Source.OFFLOAD: offload}
    out: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for s in STATS:
        if s.source is not None:
            out[s.group][s.key] = sources[s.source][s.field]
    device, host = out["device"]["hit_tokens"], out["host"]["hit_tokens"]
    total = device + host + out["requests"]["recomputed_tokens"]
    out["requests"]["hit_rate"] = (device + host) / total if total else 0.0
    out["device"]["hit_rate"] = device / total if total else 0.0
    out["host"]["hit_rate"] = host / total if total else 0.0
    return out
