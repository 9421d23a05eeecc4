"""The slot-lifecycle trace as a timeline: JSONL trace -> Trace Event Format (Perfetto, chrome://tracing).

    python -m runtime.trace timeline TRACE.jsonl -o trace.json

Every JSONL event (`runtime.trace`) is recorded by the tree actor, which owns the ledgers, with
``ts`` (wall-clock microseconds). What the timeline shows (docs/API.md, "Timeline"):

- one process per run in the file (a restarted runtime appending to the same file is run 2);
- a request's slice per admission, from its owner's first ledger event (the admission's
  ``alloc``) to its last (the ``assign``/``free`` of its finish or abort), on the tree actor's
  request lanes;
- a copy's slice per op id, from its first ``pin`` (submit) to its last ``unpin`` (ack), on the
  transfer actor's lanes (``backup``, ``load``, storage reads and writes: host pins with no
  copy event) or the offload actor's (``offload``);
- an instant per ``evict`` on the tree actor's track;
- counters of pages per tier by owner kind (request, node, session, prefetch) after every
  ledger event.

Overlapping slices go on numbered lanes of their actor (a lane never holds two at once), so
each track's begin/end events nest. Timestamps are relative to the file's first event.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

OWNER_KINDS = ("request", "node", "session", "prefetch")
TREE, REQUESTS, TRANSFER, OFFLOAD = "tree actor", "tree actor: requests", "transfer actor", "offload actor"
_TRACK_BASE = {TREE: 1, REQUESTS: 100, TRANSFER: 200, OFFLOAD: 300}


class TimelineError(ValueError):
    """The trace cannot be turned into a timeline (no timestamps, a line that is not JSON)."""


@dataclass
class _Span:
    name: str
    actor: str
    begin: int
    end: int
    args: dict[str, Any] = field(default_factory=dict)

    def end_at(self, ts: int) -> None:
        self.end = ts

    def rename(self, name: str, actor: str) -> None:
        self.name, self.actor = name, actor


@dataclass
class _Run:
    number: int
    events: list[dict[str, Any]] = field(default_factory=list)


def read_events(path: str) -> list[dict[str, Any]]:
    events = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TimelineError(f"{path}:{n}: not JSON ({exc})") from exc
    return events


def _runs(events: Iterable[Mapping[str, Any]]) -> list[_Run]:
    """Split at seq 1 (a later run appended to the same file), as the auditor does."""
    runs: list[_Run] = []
    for ev in events:
        if not runs or ev.get("seq") == 1:
            runs.append(_Run(len(runs) + 1))
        runs[-1].events.append(dict(ev))
    return runs


def _pages(ev: Mapping[str, Any]) -> list[int]:
    return [p for first, end in ev.get("pages", ()) for p in range(first, end)]


def _kind(owner: str | None) -> str:
    return (owner or "").split(":", 1)[0]


def _spans(run: _Run, t0: int) -> tuple[list[_Span], list[dict[str, Any]]]:
    """(request and copy spans, instants and counter events) of one run."""
    requests: dict[str, _Span] = {}
    copies: dict[Any, _Span] = {}
    points: list[dict[str, Any]] = []
    owned: dict[str, dict[int, str]] = {}  # tier -> page -> owner kind
    pid = run.number
    for ev in run.events:
        ts = int(ev["ts"]) - t0
        name, tier = ev.get("event"), ev.get("tier")
        for who in (ev.get("owner"), ev.get("to")):
            if isinstance(who, str) and who.startswith("request:"):
                span = requests.get(who)
                if span is None:
                    requests[who] = _Span(who.split(":", 1)[1], REQUESTS, ts, ts, {"owner": who})
                else:
                    span.end_at(ts)
        op = ev.get("op")
        if op is not None and name in ("pin", "unpin", "backup", "load", "offload"):
            span = copies.get(op)
            if span is None:  # a storage op pins host pages only: a read's belong to its prefetch
                first = next(iter(_pages(ev)), None)
                read = owned.get(str(tier), {}).get(first) == "prefetch"
                span = copies[op] = _Span("storage read" if read else "storage write", TRANSFER, ts, ts,
                                          {"op": op, "acked": False})
            if name == "unpin":
                span.end_at(ts)
                span.args["acked"] = True
            if name in ("backup", "load", "offload"):
                span.rename(name, OFFLOAD if name == "offload" else TRANSFER)
                span.args["pages"] = len(_pages(ev))
                span.args["tier"] = tier
                for key in ("node", "rid"):
                    if key in ev:
                        span.args[key] = ev[key]
        if name == "evict":
            points.append({"ph": "i", "s": "t", "name": f"evict {tier}", "pid": pid, "track": TREE, "ts": ts,
                           "args": {"pages": len(_pages(ev)), "node": ev.get("node")}})
        if name in ("alloc", "free", "assign") and isinstance(tier, str):
            pages = owned.setdefault(tier, {})
            for p in _pages(ev):
                if name == "free":
                    pages.pop(p, None)
                else:
                    pages[p] = _kind(ev.get("to") if name == "assign" else ev.get("owner"))
            counts = dict.fromkeys(OWNER_KINDS, 0)
            for kind in pages.values():
                counts[kind] = counts.get(kind, 0) + 1
            points.append({"ph": "C", "name": f"{tier} pages", "pid": pid, "track": TREE, "ts": ts, "args": counts})
    last = int(run.events[-1]["ts"]) - t0
    for span in copies.values():
        if not span.args["acked"]:  # still in flight when the run ended
            span.end_at(last)
    return list(requests.values()) + list(copies.values()), points


def _lanes(spans: list[_Span]) -> list[tuple[_Span, str]]:
    """Each span with its track name: the first lane of its actor whose last span ended before it began."""
    ends: dict[str, list[int]] = {}
    out = []
    for s in sorted(spans, key=lambda s: (s.begin, s.end)):
        lanes = ends.setdefault(s.actor, [])
        lane = next((i for i, end in enumerate(lanes) if end < s.begin), len(lanes))
        if lane == len(lanes):
            lanes.append(s.end)
        else:
            lanes[lane] = s.end
        out.append((s, f"{s.actor} {lane + 1}"))
    return out


def timeline(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The Trace Event Format document (JSON object form) of a trace's events."""
    events = list(events)
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    missing = next((e for e in events if not isinstance(e.get("ts"), int)), None)
    if missing is not None:
        raise TimelineError(f"event seq {missing.get('seq')} has no integer 'ts' (a trace from before timestamps?)")
    t0 = min(int(e["ts"]) for e in events)
    out: list[dict[str, Any]] = []
    for run in _runs(events):
        pid = run.number
        spans, points = _spans(run, t0)
        tracks: dict[str, int] = {TREE: _TRACK_BASE[TREE]}
        placed = _lanes(spans)
        for _, track in placed:
            if track not in tracks:
                actor, lane = track.rsplit(" ", 1)
                tracks[track] = _TRACK_BASE[actor] + int(lane)
        body: list[dict[str, Any]] = []
        for span, track in placed:
            tid = tracks[track]
            cat = "request" if span.actor == REQUESTS else "copy"
            body.append({"ph": "B", "name": span.name, "cat": cat, "pid": pid, "tid": tid, "ts": span.begin,
                         "args": span.args})
            body.append({"ph": "E", "name": span.name, "cat": cat, "pid": pid, "tid": tid, "ts": span.end})
        for p in points:
            p = dict(p)
            p["tid"] = tracks[p.pop("track")]
            body.append(p)
        # per track in time order; at one instant a slice ends before the next one begins
        body.sort(key=lambda e: (e["tid"], e["ts"], 0 if e["ph"] == "E" else 1))
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                    "args": {"name": f"HiCache runtime, run {pid}"}})
        for track, tid in tracks.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                        "args": {"sort_index": tid}})
        out.extend(body)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_timeline(trace_path: str, out_path: str) -> int:
    """Write the timeline of a JSONL trace file; returns the number of trace events written."""
    doc = timeline(read_events(trace_path))
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f, separators=(",", ":"))
    return len(doc["traceEvents"])
