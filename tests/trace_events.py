"""A check of the Trace Event Format (JSON object form) as Perfetto and chrome://tracing read it,
shared by the timeline tests and the demo's test."""

from __future__ import annotations

from numbers import Real

PHASES = {"B", "E", "X", "i", "I", "C", "M"}


def format_problems(doc: dict) -> list[str]:
    """What breaks the Trace Event Format (JSON object form) as Perfetto and chrome://tracing read
    it: required fields, begin/end balanced and nested per track (pid, tid), timestamps not
    going back per track, counters numeric."""
    problems: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    last: dict[tuple, float] = {}
    open_: dict[tuple, list[str]] = {}
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"#{i}: unknown phase {ph!r}")
            continue
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            problems.append(f"#{i}: pid/tid missing or not integers")
            continue
        if not isinstance(e.get("ts"), Real) or isinstance(e.get("ts"), bool) or e["ts"] < 0:
            problems.append(f"#{i}: ts missing or not a non-negative number")
            continue
        if ph != "E" and not isinstance(e.get("name"), str):
            problems.append(f"#{i}: no name")
        if ph == "M":
            if not isinstance(e.get("args"), dict):
                problems.append(f"#{i}: metadata without args")
            continue
        track = (e["pid"], e["tid"])
        if e["ts"] < last.get(track, 0):
            problems.append(f"#{i}: ts {e['ts']} before {last[track]} on track {track}")
        last[track] = e["ts"]
        if ph == "B":
            open_.setdefault(track, []).append(e["name"])
        elif ph == "E":
            stack = open_.get(track)
            if not stack:
                problems.append(f"#{i}: end without a begin on track {track}")
            elif "name" in e and e["name"] != stack[-1]:
                problems.append(f"#{i}: end of {e['name']!r} while {stack[-1]!r} is open on track {track}")
                stack.pop()
            else:
                stack.pop()
        elif ph == "C":
            args = e.get("args")
            if not isinstance(args, dict) or not args or not all(
                    isinstance(v, Real) and not isinstance(v, bool) for v in args.values()):
                problems.append(f"#{i}: counter values not all numbers: {args!r}")
        elif ph == "X" and not isinstance(e.get("dur"), Real):
            problems.append(f"#{i}: complete event without dur")
    for track, stack in open_.items():
        if stack:
            problems.append(f"unbalanced: {len(stack)} slice(s) never end on track {track}: {stack}")
    return problems
