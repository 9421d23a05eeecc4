"""The trace auditor on synthetic traces (planted bugs, each reported), the JSONL sink, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.memory.ledger import SlotLedger
from runtime.memory.owners import Owner, Tier
from runtime.audit import AuditReport, audit, audit_events, compare_final_state, main
from runtime.trace import JsonlSink, SlotTracer

REPO = Path(__file__).resolve().parents[2]


def write_trace(path: Path, events: list[dict], *, start: int = 1, mode: str = "w") -> Path:
    with open(path, mode, encoding="utf-8") as f:
        for i, ev in enumerate(events):
            f.write(json.dumps({**ev, "seq": start + i}) + "\n")
    return path


def ev(event: str, pages: list[list[int]], tier: str = "device", **fields) -> dict:
    return {"event": event, "tier": tier, "pages": pages, **fields}


R = "request:a#1"
R2 = "request:b#1"
N = "node:3"

# a request allocates, a copy backs its pages up, the tree adopts them, the request ends
CLEAN = [
    ev("alloc", [[0, 4]], owner=R, rid="a"),
    ev("assign", [[0, 2]], owner=R, to=N, rid="a", node=3),
    ev("alloc", [[0, 2]], tier="host", owner=N, node=3),
    ev("pin", [[0, 2]], op=1),
    ev("pin", [[0, 2]], tier="host", op=1),
    ev("backup", [[0, 2]], tier="host", node=3, op=1),
    ev("unpin", [[0, 2]], op=1),
    ev("unpin", [[0, 2]], tier="host", op=1),
    ev("free", [[2, 4]], owner=R, rid="a"),
    ev("free", [[1, 2]], owner=N, node=3, reason="evict"),  # (not a real split, fine for replay)
    ev("evict", [[1, 2]], node=3),
]


def run_cli(path: Path, *extra: str) -> int:
    return main([str(path), *extra])


def test_clean_trace_exits_zero(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", CLEAN)
    report = audit(path)
    assert report.clean, report.summary()
    assert report.events == len(CLEAN) and report.runs == 1
    assert report.owners == {"device": {0: N}, "host": {0: N, 1: N}}
    assert report.pins == {"device": {}, "host": {}}
    assert report.cached == {"device": 1, "host": 2}
    assert run_cli(path) == 0
    assert "CLEAN" in capsys.readouterr().out


def test_planted_use_after_free(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [
        ev("alloc", [[0, 2]], owner=R),
        ev("free", [[0, 2]], owner=R),
        ev("pin", [[1, 2]], op=7),                 # pin of a freed page
        ev("assign", [[0, 1]], owner=R, to=N),     # hand-over of a freed page
        ev("unpin", [[1, 2]], op=7),
        ev("free", [[5, 6]], owner=R2),            # free of a page never allocated
        ev("free", [[0, 1]], owner=N),
    ])
    report = audit(path)
    uaf = report.of_kind("use_after_free")
    assert [(p.seq, p.event, p.page) for p in uaf] == [(3, "pin", 1), (4, "assign", 0), (6, "free", 5)]
    assert report.kinds() == {"use_after_free": 3}
    assert run_cli(path) == 1
    out = capsys.readouterr().out
    assert "NOT CLEAN" in out and "use_after_free" in out


def test_planted_double_free(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        ev("alloc", [[0, 3]], owner=R),
        ev("free", [[0, 3]], owner=R),
        ev("free", [[1, 3]], owner=R),
    ])
    report = audit(path)
    assert report.kinds() == {"double_free": 1}
    (p,) = report.problems
    assert (p.seq, p.page, p.pages) == (3, 1, 2) and "at seq 2" in p.detail
    assert run_cli(path) == 1


def test_planted_free_while_pinned_and_reuse(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        ev("alloc", [[0, 2]], owner=N),
        ev("pin", [[0, 2]], op=4),
        ev("free", [[0, 2]], owner=N, reason="evict"),   # the copy still reads these pages
        ev("alloc", [[0, 1]], owner=R),                    # ... and one is handed out again
        ev("unpin", [[0, 2]], op=4),
        ev("free", [[0, 1]], owner=R),
    ])
    report = audit(path)
    assert report.kinds() == {"free_while_pinned": 1, "use_after_free": 1}
    fwp = report.of_kind("free_while_pinned")[0]
    assert (fwp.seq, fwp.page, fwp.pages) == (3, 0, 2) and "[4]" in fwp.detail
    assert report.of_kind("use_after_free")[0].seq == 4
    assert report.pins == {"device": {}}  # the late unpin still lands
    assert run_cli(path) == 1


def test_planted_leaks(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        ev("alloc", [[0, 2]], owner=R),
        ev("alloc", [[2, 3]], owner=N),
        ev("alloc", [[0, 1]], tier="host", owner="session:s"),
        ev("pin", [[2, 3]], op=9),
    ])
    report = audit(path)
    leaks = {(p.tier, p.pages, p.detail.split()[-1]) for p in report.of_kind("leak")}
    assert leaks == {("device", 2, R), ("host", 1, "session:s")}  # the node's page is cached
    (pin,) = report.of_kind("pin_leak")
    assert (pin.tier, pin.page) == ("device", 2) and "op 9" in pin.detail
    assert report.cached == {"device": 1, "host": 0}
    assert run_cli(path) == 1
    # sessions allowed to outlive the run, and the pin released: only the request leaks
    path2 = write_trace(tmp_path / "t2.jsonl", [
        ev("alloc", [[0, 2]], owner=R), ev("alloc", [[0, 1]], tier="host", owner="session:s")])
    assert run_cli(path2, "--allow-live", "session:", "--allow-live", "request:") == 0
    assert run_cli(path2, "--allow-live", "session:") == 1


def test_node_pages_are_cached_unless_strict(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [ev("alloc", [[0, 2]], owner=N)])
    assert audit(path).clean
    strict = audit(path, live_owners=())
    assert strict.kinds() == {"leak": 1}
    assert run_cli(path) == 0 and run_cli(path, "--strict") == 1


def test_cross_owner_use(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        ev("alloc", [[0, 2]], owner=R),
        ev("free", [[0, 1]], owner=R2),
        ev("assign", [[1, 2]], owner=R2, to=N),
        ev("alloc", [[0, 1]], tier="host", owner="node:8"),
        ev("pin", [[0, 1]], tier="host", op=2),
        ev("backup", [[0, 1]], tier="host", node=9, op=2),  # names node 9 for node 8's page
        ev("unpin", [[0, 1]], tier="host", op=2),
    ])
    report = audit(path)
    assert [(p.seq, p.kind) for p in report.problems] == [(2, "cross_owner"), (3, "cross_owner"), (6, "cross_owner")]


def test_bad_unpin_double_alloc_seq_gap_and_malformed(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [
        ev("alloc", [[0, 1]], owner=R),
        ev("alloc", [[0, 1]], owner=R2),          # double alloc
        ev("pin", [[0, 1]], op=1),
        ev("unpin", [[0, 1]], op=2),              # wrong op
        ev("unpin", [[0, 1]], op=1),              # nobody pins it any more
        ev("free", [[0, 1]], owner=R2),
    ])
    write_trace(path, [ev("alloc", [[3, 4]], owner=N)], start=9, mode="a")  # seq 7, 8 lost
    with open(path, "a") as f:
        f.write('{"event":"free","tier":"device","pa')  # truncated last line (a crash)
    report = audit(path)
    assert report.kinds() == {"double_alloc": 1, "bad_unpin": 2, "seq_gap": 1, "malformed": 1}
    assert report.of_kind("malformed")[0].line == 8
    assert run_cli(path) == 1


def test_appended_runs_are_replayed_separately(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", CLEAN)
    write_trace(path, [ev("alloc", [[0, 1]], owner=R), ev("free", [[0, 1]], owner=R)], mode="a")
    report = audit(path)
    assert report.clean and report.runs == 2
    assert report.owners == {"device": {}}  # the last run's final state
    write_trace(path, [ev("alloc", [[0, 1]], owner=R)], mode="a")
    assert audit(path).kinds() == {"leak": 1}


def test_json_output(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [ev("alloc", [[0, 1]], owner=R), ev("free", [[0, 1]], owner=R),
                                              ev("free", [[0, 1]], owner=R)])
    assert run_cli(path, "--json") == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["double_free"]


def test_missing_file_exit_code(tmp_path):
    assert run_cli(tmp_path / "nope.jsonl") == 2


def test_module_cli_runs(tmp_path):
    """`python -m runtime.audit FILE` as a user runs it (one start: torch makes it slow)."""
    bad = write_trace(tmp_path / "b.jsonl", [ev("alloc", [[0, 1]], owner=R)])
    out = subprocess.run([sys.executable, "-m", "runtime.audit", str(bad)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "leak" in out.stdout and "NOT CLEAN" in out.stdout and out.stderr == ""


# -- against a real ledger ---------------------------------------------------------------


def _random_ledger_run(tracer: SlotTracer, seed: int, steps: int = 300) -> list[SlotLedger]:
    """Random valid ledger traffic over two tiers, ending with some pages still owned and pinned."""
    rng = np.random.default_rng(seed)
    ps = tracer.page_size
    ledgers = [SlotLedger(32 * ps, ps, Tier.DEVICE, tracer), SlotLedger(16 * ps, ps, Tier.HOST, tracer)]
    held: list[tuple[SlotLedger, np.ndarray, Owner]] = []
    pinned: list[tuple[SlotLedger, np.ndarray, int]] = []
    for step in range(steps):
        choice = rng.integers(5)
        led = ledgers[int(rng.integers(2))]
        if choice == 0 and led.num_free_pages():
            owner = Owner.request(f"r{step}", 1) if rng.integers(2) else Owner.node(step)
            n = int(rng.integers(1, min(4, led.num_free_pages()) + 1))
            held.append((led, led.alloc(n, owner, rid=f"r{step}"), owner))
        elif choice == 1 and held:
            i = int(rng.integers(len(held)))
            led, slots, owner = held[i]
            if all(led.pin_count(int(s)) == 0 for s in slots[::ps]):
                del held[i]
                led.free(slots, owner)
        elif choice == 2 and held:
            i = int(rng.integers(len(held)))
            led, slots, owner = held[i]
            to = Owner.node(10_000 + step)
            led.assign(slots, owner, to, node=10_000 + step)
            held[i] = (led, slots, to)
        elif choice == 3 and held:
            led, slots, _ = held[int(rng.integers(len(held)))]
            led.pin(slots, step)
            pinned.append((led, slots, step))
        elif choice == 4 and pinned:
            led, slots, op = pinned.pop(int(rng.integers(len(pinned))))
            led.unpin(slots, op)
    return ledgers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_equals_real_ledgers(tmp_path, seed):
    path = tmp_path / "t.jsonl"
    sink = JsonlSink(str(path))
    tracer = SlotTracer(4, [sink])
    ledgers = _random_ledger_run(tracer, seed)
    tracer.close()
    snaps = [led.snapshot() for led in ledgers]
    report = audit(path, live_owners=("node:", "request:"))
    assert report.of_kind("pin_leak") or not any(s.pins.any() for s in snaps)
    assert {p.kind for p in report.problems} <= {"pin_leak"}, report.summary()
    assert compare_final_state(report, snaps) == []
    assert audit(path, live_owners=("node:", "request:"), expected=snaps).kinds() == report.kinds()
    # a ledger that differs from the trace is caught, page by page
    led = ledgers[0]
    if led.num_free_pages():
        led.alloc(1, Owner.session("ghost"))
        diffs = compare_final_state(report, {"device": led.snapshot(), "host": snaps[1]})
        assert len(diffs) == 1 and "device owner" in diffs[0] and "session:ghost" in diffs[0]
        assert audit(path, live_owners=("node:", "request:"),
                     expected=[led.snapshot(), snaps[1]]).kinds()["state_mismatch"] == 1


def test_compare_counts_an_unmentioned_tier_as_empty():
    ledger = SlotLedger(16, 4, Tier.HOST)
    report = audit_events([])
    assert isinstance(report, AuditReport) and report.clean
    assert compare_final_state(report, [ledger.snapshot(), None]) == []
    ledger.pin(ledger.alloc(1, Owner.node(1)), 5)
    diffs = compare_final_state(report, [ledger.snapshot()])
    assert len(diffs) == 2 and "host owner" in diffs[0] and "host pins" in diffs[1]


# -- the sink ---------------------------------------------------------------------------


def test_jsonl_sink_lines_seq_flush_and_close(tmp_path):
    path = tmp_path / "s.jsonl"
    sink = JsonlSink(str(path))
    tracer = SlotTracer(2, [sink])
    tracer.emit("alloc", "device", np.arange(4, dtype=np.int64), owner="request:x\ny#1", rid="multi\nline")
    tracer.emit("free", "device", np.arange(4, dtype=np.int64), owner="request:x\ny#1")
    sink.flush()
    lines = path.read_text().splitlines()
    assert len(lines) == 2  # a newline inside a value stays escaped: one line per event
    records = [json.loads(x) for x in lines]
    assert [r["seq"] for r in records] == [1, 2] and records[0]["pages"] == [[0, 2]]
    tracer.emit("alloc", "device", np.arange(2, dtype=np.int64), owner="node:1")
    tracer.close()  # flushes the buffered event
    assert sink.closed and sink.seq == 3
    assert len(path.read_text().splitlines()) == 3
    tracer.close()  # idempotent
    sink({"event": "late", "tier": "device"})  # after close: dropped, no error
    assert sink.dropped == 1 and len(path.read_text().splitlines()) == 3
    assert audit(path).clean
