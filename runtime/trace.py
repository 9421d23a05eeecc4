"""Structured logging and the slot-lifecycle trace.

Every ledger operation is one event (never one per slot) with stable fields:
``event`` (alloc, assign, pin, unpin, free, evict, backup, load, offload, release),
``tier``, ``pages`` (run-length page ranges ``[[first, end), ...]``), ``owner``,
``to`` (hand-over target), ``op`` (transfer op id), plus free-form context (``rid``, ``node``).

Library logging (`get_logger`): structlog bound to stdlib `logging` loggers under ``hicache``, so
the application's `logging` set-up governs it as any library's. Production default: slot events
are debug events (built only when the ``hicache.slots`` logger is enabled for debug) and, when a ``trace_path`` is configured, every event is also
appended to a JSONL file that `python -m runtime.audit FILE` can replay (`runtime/audit.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import structlog

LOGGER_ROOT = "hicache"  # every library logger is a stdlib `logging` logger under it


def _render(_logger: Any, _method: str, event: dict[str, Any]) -> tuple[tuple[str], dict[str, Any]]:
    """The last processor: the stdlib record's message is the event's name and fields
    (``name k=v ...``); the event itself rides along as the record's ``hicache`` attribute, for
    a handler that renders it otherwise (`configure_logging`'s JSON)."""
    name = event.get("event", "")
    fields = " ".join(f"{k}={v!r}" for k, v in event.items() if k != "event")
    return ((f"{name} {fields}" if fields else str(name)),), {"extra": {"hicache": event}}


def get_logger(name: str) -> Any:
    """A library logger: structlog bound to the stdlib logger `name` (``hicache.*``), with its own
    processors, so nothing here configures structlog or depends on how the embedder did. As any
    library's: the application's `logging` set-up decides what is shown (Python's default shows
    WARNING and above on stderr; `logging.basicConfig(level=logging.DEBUG)` shows every event),
    and an event below the logger's level is dropped before anything is rendered."""
    if name != LOGGER_ROOT and not name.startswith(LOGGER_ROOT + "."):
        raise ValueError(f"library loggers live under {LOGGER_ROOT!r}, got {name!r}")
    return structlog.stdlib.BoundLogger(logging.getLogger(name),
                                        [structlog.stdlib.filter_by_level, _render], context={})


class _EventFormatter(logging.Formatter):
    """`configure_logging`'s renderer: a record of a library event as one line (console or JSON)."""

    def __init__(self, json_output: bool) -> None:
        super().__init__()
        self.json_output = json_output

    def format(self, record: logging.LogRecord) -> str:
        event = dict(getattr(record, "hicache", None) or {"event": record.getMessage()})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        if self.json_output:
            return json.dumps({"timestamp": ts, "level": record.levelname.lower(), "logger": record.name, **event},
                              default=str)
        name = event.pop("event", "")
        fields = " ".join(f"{k}={v}" for k, v in event.items())
        return f"{ts} [{record.levelname.lower():<8}] {name:<30} {fields}".rstrip()


_HANDLER_MARK = "_hicache_configured"


def configure_logging(*, json_output: bool = False, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """An application's logging set-up for the library's events (the demo, benchmarks, tests):
    one handler on the ``hicache`` logger at `level`, to `stream` (stderr by default), one line
    per event (console or JSON). Never called by the library itself; called again, it replaces
    the handler it added before."""
    root = logging.getLogger(LOGGER_ROOT)
    for h in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_EventFormatter(json_output))
    setattr(handler, _HANDLER_MARK, True)
    root.addHandler(handler)
    root.setLevel(level)


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


def file_problem(path: str) -> str | None:
    """Why a `JsonlSink` cannot append to `path`, or None: an existing file this process can
    write, or a new one in an existing, writable directory (parents are not created). Nothing is
    created; the words follow the path in a message."""
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is a file that is not writable"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"cannot be created: its directory {parent!r} " + (
            "is not a directory" if os.path.exists(parent) else "does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: its directory {parent!r} is not writable"
    return None


class JsonlSink:
    """Appends one JSON object per event, one line each, to a file.

    Every record gets ``seq``: 1, 2, 3, ... in emission order (the auditor checks there is no
    gap; a file appended to by a later run starts again at 1, which the auditor reads as a new
    run) and ``ts``: wall-clock microseconds since the epoch (so runs of several processes in
    one file line up on a timeline: `runtime.timeline`). Each event is written with a single ``write`` of one complete line (JSON escapes any
    newline inside a value); Python's buffer batches them. ``flush`` pushes the buffer to the
    OS; ``close`` flushes and closes and is idempotent. Events emitted after ``close`` are
    dropped and counted in ``dropped`` (an actor stopping late never fails on a closed file).
    """

    def __init__(self, path: str, *, buffering: int = 1 << 16) -> None:
        self.path = str(path)
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8", buffering=buffering)
        self._seq = 0
        self.dropped = 0

    @property
    def seq(self) -> int:
        """The seq of the last event written (0 before the first)."""
        return self._seq

    @property
    def closed(self) -> bool:
        return self._file is None

    def __call__(self, event: dict[str, Any]) -> None:
        f = self._file
        if f is None:
            self.dropped += 1
            return
        self._seq += 1
        event["seq"] = self._seq
        event["ts"] = time.time_ns() // 1000
        f.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.flush()
            finally:
                f.close()

    def __del__(self) -> None:  # a sink dropped without close still leaves whole lines behind
        try:
            self.close()
        except Exception:
            pass


class SlotTracer:
    """Emits slot-lifecycle events. Cheap when nobody listens: one flag test per event."""

    def __init__(self, page_size: int, sinks: list[Sink] | None = None) -> None:
        self.page_size = page_size
        self._sinks: list[Sink] = list(sinks or [])
        self._log = get_logger("hicache.slots")
        # slot events are opt-in: one level check here, so an inactive tracer builds no event
        self._debug = self._log.isEnabledFor(logging.DEBUG)
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


def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.trace timeline TRACE.jsonl [-o OUT.json]``: the trace as a timeline
    (Trace Event Format, for Perfetto or chrome://tracing; `runtime.timeline`)."""
    from runtime.timeline import TimelineError, write_timeline

    p = argparse.ArgumentParser(prog="python -m runtime.trace", description="slot-lifecycle trace tools")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("timeline", help="write the trace as Trace Event Format JSON (Perfetto, chrome://tracing)")
    t.add_argument("trace", help="JSONL trace (RuntimeConfig.trace_path)")
    t.add_argument("-o", "--output", help="output file (default: TRACE with .timeline.json)")
    args = p.parse_args(argv)
    out = args.output or (args.trace[: -len(".jsonl")] if args.trace.endswith(".jsonl") else args.trace) + ".timeline.json"
    try:
        n = write_timeline(args.trace, out)
    except (OSError, TimelineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{out}: {n} trace events; open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
