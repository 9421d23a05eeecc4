"""The trace as a timeline (`runtime.timeline`, `python -m runtime.trace timeline`): the output is
valid Trace Event Format, and every request admission and every copy of a real runtime's trace
appears once, at the times the calls were made. The format check is shown to bite on planted
faults (an unbalanced slice, time running backwards on a track, a non-numeric counter); and with
`timeline()` planted to leave its last slice open, these tests failed ("unbalanced: 1 slice(s)
never end on track (1, 201): ['backup']")."""

from __future__ import annotations

import copy
import json
import time
from collections import Counter

import numpy as np
import pytest

from runtime.audit import audit
from runtime.runtime import CacheRuntime
from runtime.timeline import OWNER_KINDS, TimelineError, timeline, write_timeline
from runtime.trace import main as trace_main
from tests.integration.support import compute, settle, small_config, toks
from tests.trace_events import format_problems

def now_us() -> int:
    return time.time_ns() // 1000


async def serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, calls: dict, reply_len: int = 3) -> tuple[int, int]:
    """One request as a serving loop runs it; notes the wall-clock bounds of its admit and finish."""
    before = now_us()
    res = await rt.admit(rid, tokens)
    admitted = now_us()
    for r in res.readiness:
        await r.wait_all()
    compute(rt, res.slots, tokens, start=res.cached)
    new = await rt.extend(rid, reply_len)
    full = np.concatenate((tokens, toks(reply_len, 99)))
    compute(rt, np.concatenate((res.slots.numpy(), new.numpy())), full, start=len(tokens))
    finishing = now_us()
    await rt.finish(rid, full)
    calls[f"request:{rid}#{res.generation}"] = (before, admitted, finishing, now_us())
    return res.cached_device, res.loaded_host


@pytest.fixture
async def recorded(tmp_path):
    """A real runtime's trace: requests, evictions, backups and a host->device load."""
    path = tmp_path / "trace.jsonl"
    calls: dict[str, tuple[int, int, int, int]] = {}
    cfg = small_config(device_slots=128, host_tokens=512, copy_engine="cpu", trace_path=str(path))
    async with CacheRuntime.open(cfg) as rt:
        prompts = [toks(60, 10 + i) for i in range(4)]
        for i, p in enumerate(prompts):
            await serve(rt, f"r{i}", p, calls)
            await settle(rt)
        _, loaded = await serve(rt, "again", np.concatenate((prompts[0], toks(7, 5))), calls)
        assert loaded > 0  # evicted by the later prompts: back from host
        await settle(rt)
    return path, calls


async def test_timeline_of_a_runtime_trace_is_valid_and_complete(recorded, tmp_path):
    path, calls = recorded
    events = [json.loads(line) for line in path.read_text().splitlines()]
    out = tmp_path / "trace.json"
    assert trace_main(["timeline", str(path), "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert format_problems(doc) == []
    t0 = min(e["ts"] for e in events)
    tev = doc["traceEvents"]
    names = {e["args"]["name"] for e in tev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert any(n.startswith("tree actor: requests") for n in names) and any(n.startswith("transfer actor") for n in names)

    # every admission: one slice, from within its admit call to within its finish call
    begins = [e for e in tev if e["ph"] == "B" and e["cat"] == "request"]
    assert Counter(e["args"]["owner"] for e in begins) == Counter(list(calls))
    ends = {(e["pid"], e["tid"], e["ts"]) for e in tev if e["ph"] == "E" and e["cat"] == "request"}
    for b in begins:
        before, admitted, finishing, finished = calls[b["args"]["owner"]]
        assert before <= b["ts"] + t0 <= admitted, b
        end = next(e for e in tev if e["ph"] == "E" and e["tid"] == b["tid"] and e["ts"] >= b["ts"]
                   and e["name"] == b["name"])
        assert (end["pid"], end["tid"], end["ts"]) in ends
        assert finishing <= end["ts"] + t0 <= finished, (b, end)

    # every copy (op id): one slice, from its first pin (submit) to its last unpin (ack)
    ops: dict[int, list[dict]] = {}
    for e in events:
        if "op" in e:
            ops.setdefault(e["op"], []).append(e)
    copies = [e for e in tev if e["ph"] == "B" and e["cat"] == "copy"]
    assert Counter(e["args"]["op"] for e in copies) == Counter({op: 1 for op in ops})
    kinds = Counter(e["name"] for e in copies)
    assert kinds["backup"] > 0 and kinds["load"] > 0
    for b in copies:
        evs = ops[b["args"]["op"]]
        assert b["ts"] + t0 == min(e["ts"] for e in evs if e["event"] == "pin")
        end = next(e for e in tev if e["ph"] == "E" and e["tid"] == b["tid"] and e["ts"] >= b["ts"])
        assert end["ts"] + t0 == max(e["ts"] for e in evs if e["event"] == "unpin")
        copy_events = [e["event"] for e in evs if e["event"] in ("backup", "load", "offload")]
        assert copy_events in ([b["name"]], []), (b, copy_events)

    # the counters end where the auditor's replay of the same trace ends
    report = audit(str(path))
    for tier, owners in report.owners.items():
        want = dict.fromkeys(OWNER_KINDS, 0) | Counter(o.split(":", 1)[0] for o in owners.values())
        last = [e for e in tev if e["ph"] == "C" and e["name"] == f"{tier} pages"][-1]
        assert last["args"] == want, tier


async def test_format_check_catches_planted_faults(recorded):
    """The same valid document with one fault planted at a time: each is reported."""
    path, _ = recorded
    doc = timeline(json.loads(line) for line in path.read_text().splitlines())
    assert format_problems(doc) == []

    unbalanced = copy.deepcopy(doc)
    i = next(i for i, e in enumerate(unbalanced["traceEvents"]) if e["ph"] == "E")
    del unbalanced["traceEvents"][i]
    assert any("unbalanced" in p for p in format_problems(unbalanced))

    backwards = copy.deepcopy(doc)
    track_events = [e for e in backwards["traceEvents"] if e["ph"] == "C"]
    track_events[-1]["ts"] = track_events[0]["ts"] - 1 if track_events[0]["ts"] else -1
    assert format_problems(backwards)

    text_counter = copy.deepcopy(doc)
    next(e for e in text_counter["traceEvents"] if e["ph"] == "C")["args"]["node"] = "3"
    assert any("counter" in p for p in format_problems(text_counter))


def test_two_runs_in_one_file_are_two_processes(tmp_path):
    base = 1_700_000_000_000_000
    run = [{"event": "alloc", "tier": "device", "pages": [[0, 2]], "owner": "request:a#1", "rid": "a"},
           {"event": "free", "tier": "device", "pages": [[0, 2]], "owner": "request:a#1", "rid": "a"}]
    events = [{**e, "seq": i + 1, "ts": base + 10 * i} for i, e in enumerate(run)]
    events += [{**e, "seq": i + 1, "ts": base + 1000 + 10 * i} for i, e in enumerate(run)]
    doc = timeline(events)
    assert format_problems(doc) == []
    begins = [e for e in doc["traceEvents"] if e["ph"] == "B"]
    assert [(e["pid"], e["ts"]) for e in begins] == [(1, 0), (2, 1000)]


def test_a_trace_without_timestamps_is_refused(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"event": "alloc", "tier": "device", "pages": [[0, 1]], "owner": "node:1", "seq": 1}) + "\n")
    with pytest.raises(TimelineError, match="ts"):
        write_timeline(str(path), str(tmp_path / "out.json"))
    assert trace_main(["timeline", str(path)]) == 2
