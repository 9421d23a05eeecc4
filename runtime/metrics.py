"""Prometheus metrics: the `stats()` table (`runtime.stats.STATS`) as `hicache_*` metric families.

The counters live inside the actors, on the event loop; a scrape runs on the HTTP server's
thread (or wherever the embedder calls `generate_latest`). So the collector never asks an actor
anything: the runtime stores the latest `stats()` dict here (`StatsCollector.update`, one
reference assignment, atomic under the GIL) every `metrics_interval_s` and on
`CacheRuntime.refresh_metrics()`, and `collect()` only reads that snapshot, which nobody mutates
after it is stored. A scrape therefore never blocks the loop, never waits for it, and after a
refresh its values are exactly that `stats()` dict.

Registered on the registry the embedder passes (never prometheus_client's global REGISTRY
unless the embedder passes that one), and unregistered at close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from runtime.errors import ConfigError, HiCacheError
from runtime.stats import STATS, Kind, Stat
from runtime.trace import get_logger

log = get_logger("hicache.metrics")

_FAMILY = {Kind.COUNTER: CounterMetricFamily, Kind.GAUGE: GaugeMetricFamily, Kind.HISTOGRAM: HistogramMetricFamily}


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric family: its stats() values, one sample set each (labels tell them apart)."""

    name: str
    kind: Kind
    help: str
    label_names: tuple[str, ...]
    stats: tuple[Stat, ...]


def _families() -> tuple[Family, ...]:
    grouped: dict[str, list[Stat]] = {}
    for s in STATS:
        if s.metric is not None:
            grouped.setdefault(s.metric, []).append(s)
    out = []
    for name, stats in grouped.items():
        first = stats[0]
        labels = tuple(k for k, _ in first.labels)
        if any(s.kind is not first.kind or tuple(k for k, _ in s.labels) != labels for s in stats):
            raise AssertionError(f"metric {name}: its stats differ in kind or label names")
        # a family's help: the meaning its values share (those with labels differ only by them)
        out.append(Family(name, first.kind, first.help if len(stats) == 1 else _shared_help(stats), labels,
                          tuple(stats)))
    return tuple(out)


def _shared_help(stats: list[Stat]) -> str:
    helps = dict.fromkeys(s.help for s in stats)
    return "; ".join(helps)


FAMILIES: tuple[Family, ...] = _families()


class StatsCollector(Collector):
    """A custom collector over the latest stats snapshot (see the module docstring)."""

    def __init__(self) -> None:
        self._snapshot: Mapping[str, Mapping[str, Any]] | None = None

    def update(self, snapshot: Mapping[str, Mapping[str, Any]]) -> None:
        """Store a fresh `stats()` dict (the caller hands it over: it is never changed again)."""
        self._snapshot = snapshot

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registering needs no snapshot (nor the loop)."""
        for fam in FAMILIES:
            yield _FAMILY[fam.kind](fam.name, fam.help, labels=fam.label_names)

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot  # one read: the whole scrape sees one snapshot
        if snap is None:
            return
        for fam in FAMILIES:
            metric = _FAMILY[fam.kind](fam.name, fam.help, labels=fam.label_names)
            for s in fam.stats:
                value = snap[s.group][s.key]
                labels = [v for _, v in s.labels]
                if fam.kind is Kind.HISTOGRAM:
                    metric.add_metric(labels, list(value["buckets"].items()), value["sum_seconds"])
                else:
                    metric.add_metric(labels, value)
            yield metric


class MetricsEndpoint:
    """The optional `/metrics` HTTP endpoint (prometheus_client's server, one daemon thread)."""

    def __init__(self, registry: CollectorRegistry, addr: str, port: int) -> None:
        self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        self.addr = addr
        self.port: int = self._server.server_port  # the bound port (port 0: the one the OS picked)
        log.info("metrics_endpoint_started", addr=addr, port=self.port)

    def stop(self) -> None:
        """Blocking (up to the server's 0.5 s poll): call it off the event loop."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        log.info("metrics_endpoint_stopped", addr=self.addr, port=self.port)


Snapshot = dict[str, dict[str, Any]]


class MetricsExporter:
    """A runtime's metrics from open to close: its collector registered on `registry`, the first
    snapshot, the endpoint (with `metrics_port`), the refresh every `metrics_interval_s`, and their
    teardown. `take_snapshot` is the runtime's `stats()`."""

    def __init__(self, registry: CollectorRegistry, take_snapshot: Callable[[], Awaitable[Snapshot]], *,
                 interval_s: float, addr: str, port: int | None) -> None:
        self.registry = registry
        self.collector = StatsCollector()
        self.endpoint: MetricsEndpoint | None = None
        self._take_snapshot = take_snapshot
        self._interval_s = interval_s
        self._addr, self._port = addr, port
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int | None:
        """The port the endpoint is bound to (None without one)."""
        return self.endpoint.port if self.endpoint is not None else None

    def register(self) -> None:
        try:
            self.registry.register(self.collector)
        except ValueError as exc:  # names taken: another runtime (or anything) exports hicache_* there
            raise ConfigError(f"metrics_registry already has these metrics ({exc}); "
                              f"give each runtime a registry of its own") from None

    async def refresh(self) -> Snapshot:
        """A snapshot handed to the collector (nobody changes it again)."""
        snapshot = await self._take_snapshot()
        self.collector.update(snapshot)
        return snapshot

    async def start(self) -> None:
        """The first snapshot, the endpoint (if asked for), then the periodic refresh."""
        await self.refresh()
        if self._port is not None:
            self.endpoint = MetricsEndpoint(self.registry, self._addr, self._port)
        self._task = asyncio.get_running_loop().create_task(self._refresh_every(), name="hicache-metrics")

    async def _refresh_every(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.refresh()  # (no copy: nobody reads it here)
            except HiCacheError:  # closing or failed: the last snapshot stays until close unregisters
                return

    async def stop(self) -> None:
        """At close, first: no refresh asks a closing actor; the endpoint and registration go."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():  # our caller was cancelled, not the task
                    raise
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            await asyncio.to_thread(endpoint.stop)  # shutdown() waits for the server's poll loop
        try:
            self.registry.unregister(self.collector)
        except KeyError:  # never registered (open refused it), or already gone
            pass
