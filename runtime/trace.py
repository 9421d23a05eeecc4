"""Structured logging and the slot-lifecycle trace.

Every ledger operation is one event (never one per slot) with stable fields:
``event`` (alloc, assign, pin, unpin, free, evict, backup, load, offload, release),
``tier``, ``pages`` (run-length page ranges ``[[first, end), ...]``), ``owner``,
``to`` (hand-over target), ``op`` (transfer op id), plus free-form context (``rid``, ``node``).

Production default: events go to structlog at debug level (dropped cheaply unless the
embedder enables debug) and, when a ``trace_path`` is configured, every event is also
appended to a JSONL file that `python -m runtime.trace audit FILE` can replay.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import structlog

_configured = False


def configure_logging(*, json_output: bool = False, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Configure structlog once for the process (the embedder may call it again to change it)."""
    global _configured
    renderer = structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=stream or sys.stderr),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> Any:
    if not _configured:
        configure_logging()
    return structlog.get_logger(name)


def page_runs(slots: np.ndarray, page_size: int) -> list[list[int]]:
    """Run-length page ranges ``[[first_page, end_page), ...]`` of page-aligned slot indices, in order."""
    if len(slots) == 0:
        return []
    pages = np.asarray(slots[::page_size], dtype=np.int64) // page_size
    if len(pages) == 1:
        p = int(pages[0])
        return [[p, p + 1]]
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(pages)]))
    return [[int(pages[s]), int(pages[e - 1]) + 1] for s, e in zip(starts.tolist(), ends.tolist())]


Sink = Callable[[dict[str, Any]], None]


class JsonlSink:
    """Appends one JSON object per event to a file (line-buffered writes batched by Python's buffer)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8", buffering=1 << 16)
        self._seq = 0

    def __call__(self, event: dict[str, Any]) -> None:
        self._seq += 1
        event["seq"] = self._seq
        self._file.write(json.dumps(event, separators=(",", ":"), default=str))
        self._file.write("\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


class SlotTracer:
    """Emits slot-lifecycle events. Cheap when nobody listens: one flag test per event."""

    def __init__(self, page_size: int, sinks: list[Sink] | None = None) -> None:
        self.page_size = page_size
        self._sinks: list[Sink] = list(sinks or [])
        self._log = get_logger("hicache.slots")
        self._debug = self._log.is_enabled_for(logging.DEBUG) if hasattr(self._log, "is_enabled_for") else True
        self.active = bool(self._sinks) or self._debug

    def add_sink(self, sink: Sink) -> None:
        self._sinks.append(sink)
        self.active = True

    def emit(self, event: str, tier: str, slots: np.ndarray | None = None, owner: object = None, **fields: Any) -> None:
        if not self.active:
            return
        record: dict[str, Any] = {"event": event, "tier": tier}
        if slots is not None:
            record["pages"] = page_runs(slots, self.page_size)
        if owner is not None:
            record["owner"] = str(owner)
        for key, value in fields.items():
            if value is not None:
                record[key] = str(value) if not isinstance(value, (int, float, str, bool, list)) else value
        for sink in self._sinks:
            sink(dict(record))
        if self._debug:
            self._log.debug(**record)

    def close(self) -> None:
        for sink in self._sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
