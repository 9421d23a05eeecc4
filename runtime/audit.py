"""The trace auditor: replays a JSONL slot-lifecycle trace (written by `runtime.trace`).

`audit(path) -> AuditReport` replays a trace per tier and per page (owner, pins) and reports
use-after-free, double free, free while pinned, cross-owner use and leaks;
`compare_final_state(report, snapshots)` checks the replayed final state against live
`LedgerSnapshot`s. CLI::

    python -m runtime.audit FILE [--allow-live OWNER_PREFIX]... [--strict] [--json]

exits 0 only when the trace is clean (1 with problems, 2 when the file cannot be read). Tree
nodes (``node:*``) may keep pages at the end (cached, not leaked); everything else may not.

What it reports (a trace records what the runtime *did*: with a correct ledger none of these
can appear, so any one is a bug in the ledger or in code that went around it):
tier: who owns each page and which in-flight copies (op ids) pin it. It reports misuse the
ledgers should have refused (a trace records what the runtime *did*: with a correct ledger
none of these can appear, so any one is a bug in the ledger or in code that went around it):

  use_after_free     pin/assign/free of a free page that was never freed before, an alloc of a
                     free page still pinned by an in-flight copy, a backup/load/offload naming
                     free pages or pages its copy does not pin
  double_free        free of a page already freed (and not allocated again since)
  free_while_pinned  free of a page an in-flight copy still pins
  cross_owner        assign/free by an owner that does not own the page (or a backup naming a
                     node for host pages another owner holds)
  double_alloc       alloc of a page that is still owned
  bad_unpin          unpin of a page not pinned, or not pinned by that op
  leak               pages still owned at the end of a run by an owner not allowed to outlive it
                     (requests, sessions, prefetches: anything but tree nodes by default)
  pin_leak           pins still held at the end of a run
  seq_gap            lost events (seq jumps) or events out of order
  malformed          a line that is not a well-formed event
  state_mismatch     the replayed final state differs from the expected ledger snapshots

Replay follows what the trace says happened even when it is wrong (a free by the wrong owner
still frees the page; a free of a pinned page keeps its pins, as the buggy ledger did), so
the replayed state stays comparable with the live ledgers and one bug is reported once.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROBLEM_KINDS = (
    "use_after_free", "double_free", "free_while_pinned", "cross_owner", "double_alloc", "bad_unpin",
    "leak", "pin_leak", "seq_gap", "malformed", "state_mismatch",
)
LEDGER_EVENTS = ("alloc", "free", "assign", "pin", "unpin")
DEFAULT_LIVE_OWNERS: tuple[str, ...] = ("node:",)  # tree nodes legitimately keep cached pages at close


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding. ``page`` is the first page concerned and ``pages`` how many the event touched
    that way (one problem per event and kind, not per page). ``seq`` is None for end-of-run
    findings (leaks) and for lines without one."""

    seq: int | None
    event: str
    tier: str | None
    page: int | None
    kind: str
    detail: str
    pages: int = 1
    line: int | None = None

    def __str__(self) -> str:
        where = f"seq {self.seq}" if self.seq is not None else ("end of run" if self.line is None else f"line {self.line}")
        page = "" if self.page is None else f" page {self.page}" + (f" (+{self.pages - 1} more)" if self.pages > 1 else "")
        tier = f" {self.tier}" if self.tier else ""
        what = (tier + page).strip() if self.event == "end" else f"{self.event}{tier}{page}"
        return f"{where}: {self.kind}: {what}: {self.detail}"


@dataclass
class AuditReport:
    """What a replay found. ``owners[tier][page]`` and ``pins[tier][page]`` are the final state of
    the last run in the file (free pages and zero pin counts left out); ``cached[tier]`` counts
    pages still owned by allowed-live owners (tree nodes: cached, not leaked)."""

    path: str | None
    events: int = 0
    runs: int = 0
    problems: list[Problem] = field(default_factory=list)
    owners: dict[str, dict[int, str]] = field(default_factory=dict)
    pins: dict[str, dict[int, int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    live_owners: tuple[str, ...] = DEFAULT_LIVE_OWNERS

    @property
    def clean(self) -> bool:
        return not self.problems

    def kinds(self) -> Counter[str]:
        return Counter(p.kind for p in self.problems)

    def of_kind(self, kind: str) -> list[Problem]:
        return [p for p in self.problems if p.kind == kind]

    def summary(self, max_problems: int = 20) -> str:
        lines = [f"trace {self.path or '<events>'}: {self.events} events, {self.runs} run(s)"]
        for tier in sorted(set(self.owners) | set(self.pins)):
            owned = len(self.owners.get(tier, {}))
            cached = self.cached.get(tier, 0)
            pinned = len(self.pins.get(tier, {}))
            lines.append(f"  {tier}: {owned} pages owned at end ({cached} cached by "
                         f"{', '.join(self.live_owners) or 'nobody'}, {owned - cached} other), {pinned} pinned")
        if self.clean:
            lines.append("CLEAN: no use-after-free, double free, free while pinned, cross-owner use or leak")
            return "\n".join(lines)
        counts = self.kinds()
        lines.append(f"{len(self.problems)} problem(s): " + ", ".join(f"{k} {counts[k]}" for k in PROBLEM_KINDS if counts[k]))
        for p in self.problems[:max_problems]:
            lines.append(f"  {p}")
        if len(self.problems) > max_problems:
            lines.append(f"  ... {len(self.problems) - max_problems} more")
        lines.append("NOT CLEAN")
        return "\n".join(lines)


class _Tier:
    __slots__ = ("owner", "pins", "freed_at")

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.pins: dict[int, list[Any]] = {}  # page -> op ids pinning it (a page may be pinned twice)
        self.freed_at: dict[int, int | None] = {}  # free page -> seq of the free that released it


def _expand_runs(runs: Any) -> list[int]:
    if not isinstance(runs, list):
        raise ValueError("pages is not a list")
    pages: list[int] = []
    for run in runs:
        if (not isinstance(run, list) or len(run) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
                or run[0] < 0 or run[1] <= run[0]):
            raise ValueError(f"bad page run {run!r}")
        pages.extend(range(run[0], run[1]))
    return pages


def _owned_by_live(owner: str, live: tuple[str, ...]) -> bool:
    return owner.startswith(live) if live else False


class TraceAuditor:
    """Incremental replay: `feed` events (dicts, in order), then `finish` for the report.

    ``live_owners``: owner prefixes whose pages may legitimately stay owned at the end of a
    run (default: tree nodes, ``"node:"``); pass ``()`` to count every owned page as a leak.
    """

    def __init__(self, *, live_owners: Iterable[str] = DEFAULT_LIVE_OWNERS, path: str | None = None) -> None:
        self.live_owners = tuple(live_owners)
        self.report = AuditReport(path=path, live_owners=self.live_owners)
        self._tiers: dict[str, _Tier] = {}
        self._last_seq: int | None = None
        self._finished = False

    # -- input ---------------------------------------------------------------------
    def feed_line(self, text: str, line: int | None = None) -> None:
        text = text.strip()
        if not text:
            return
        try:
            record = json.loads(text)
        except ValueError as exc:
            self._problem(None, "?", None, None, "malformed", f"not JSON ({exc}): {text[:80]!r}", line=line)
            return
        if not isinstance(record, dict):
            self._problem(None, "?", None, None, "malformed", f"not a JSON object: {text[:80]!r}", line=line)
            return
        self.feed(record, line=line)

    def feed(self, record: Mapping[str, Any], line: int | None = None) -> None:
        rep = self.report
        seq = record.get("seq")
        event = record.get("event")
        if not isinstance(event, str):
            self._problem(seq, "?", None, None, "malformed", "no event name", line=line)
            return
        if isinstance(seq, int) and not isinstance(seq, bool):
            last = self._last_seq
            if last is None:
                rep.runs += 1
            elif seq <= last:
                if seq == 1:  # a later run appended to the same file
                    self._end_run()
                    rep.runs += 1
                else:
                    self._problem(seq, event, None, None, "seq_gap", f"seq {seq} after {last} (out of order)", line=line)
            elif seq != last + 1:
                self._problem(seq, event, None, None, "seq_gap", f"seq jumps from {last} to {seq}: "
                              f"{seq - last - 1} event(s) missing", line=line)
            self._last_seq = seq
        else:
            if self._last_seq is None and rep.runs == 0:
                rep.runs = 1
            seq = None
        rep.events += 1
        tier_name = record.get("tier")
        if event not in LEDGER_EVENTS and event not in ("backup", "load", "offload"):
            return  # evict, release, ...: context; the ledger events carry the state
        if not isinstance(tier_name, str):
            self._problem(seq, event, None, None, "malformed", "no tier", line=line)
            return
        try:
            pages = _expand_runs(record.get("pages", []))
        except ValueError as exc:
            self._problem(seq, event, tier_name, None, "malformed", str(exc), line=line)
            return
        tier = self._tiers.get(tier_name)
        if tier is None:
            tier = self._tiers[tier_name] = _Tier()
        owner = record.get("owner")
        getattr(self, "_on_" + event)(seq, tier_name, tier, pages, None if owner is None else str(owner), record)

    # -- ledger events -----------------------------------------------------------------
    def _on_alloc(self, seq, tname, tier, pages, owner, record) -> None:
        if owner is None:
            self._problem(seq, "alloc", tname, pages[0] if pages else None, "malformed", "alloc without an owner")
            return
        owned, pinned = [], []
        for p in pages:
            prev = tier.owner.get(p)
            if prev is not None:
                owned.append((p, prev))
            if tier.pins.get(p):
                pinned.append(p)
            tier.owner[p] = owner
            tier.freed_at.pop(p, None)
        if owned:
            p, prev = owned[0]
            self._problem(seq, "alloc", tname, p, "double_alloc", f"alloc for {owner} of a page {prev} still owns", len(owned))
        if pinned:
            p = pinned[0]
            self._problem(seq, "alloc", tname, p, "use_after_free",
                          f"alloc for {owner} of a free page still pinned by op(s) {tier.pins[p]} "
                          f"(an in-flight copy uses a reused page)", len(pinned))

    def _on_free(self, seq, tname, tier, pages, owner, record) -> None:
        double, never, cross, pinned = [], [], [], []
        for p in pages:
            prev = tier.owner.get(p)
            if prev is None:
                if p in tier.freed_at:
                    double.append((p, tier.freed_at[p]))
                else:
                    never.append(p)
            elif owner is not None and prev != owner:
                cross.append((p, prev))
            if tier.pins.get(p):
                pinned.append(p)
            tier.owner.pop(p, None)
            tier.freed_at[p] = seq
        who = owner or "an unnamed owner"
        if double:
            p, first = double[0]
            self._problem(seq, "free", tname, p, "double_free", f"free by {who} of a page already freed"
                          + ("" if first is None else f" at seq {first}"), len(double))
        if never:
            self._problem(seq, "free", tname, never[0], "use_after_free", f"free by {who} of a page never allocated", len(never))
        if cross:
            p, prev = cross[0]
            self._problem(seq, "free", tname, p, "cross_owner", f"free by {who} of a page {prev} owns", len(cross))
        if pinned:
            p = pinned[0]
            self._problem(seq, "free", tname, p, "free_while_pinned",
                          f"free by {who} of a page pinned by in-flight op(s) {tier.pins[p]}", len(pinned))

    def _on_assign(self, seq, tname, tier, pages, owner, record) -> None:
        to = record.get("to")
        if to is None:
            self._problem(seq, "assign", tname, pages[0] if pages else None, "malformed", "assign without 'to'")
            return
        to = str(to)
        free_, cross = [], []
        for p in pages:
            prev = tier.owner.get(p)
            if prev is None:
                free_.append(p)
            elif owner is not None and prev != owner:
                cross.append((p, prev))
            tier.owner[p] = to
            tier.freed_at.pop(p, None)
        if free_:
            self._problem(seq, "assign", tname, free_[0], "use_after_free",
                          f"assign {owner} -> {to} of a free page", len(free_))
        if cross:
            p, prev = cross[0]
            self._problem(seq, "assign", tname, p, "cross_owner", f"assign by {owner} (to {to}) of a page {prev} owns", len(cross))

    def _on_pin(self, seq, tname, tier, pages, owner, record) -> None:
        op = record.get("op")
        free_ = []
        for p in pages:
            if p not in tier.owner:
                free_.append(p)
            tier.pins.setdefault(p, []).append(op)
        if free_:
            self._problem(seq, "pin", tname, free_[0], "use_after_free", f"pin (op {op}) of a free page", len(free_))

    def _on_unpin(self, seq, tname, tier, pages, owner, record) -> None:
        op = record.get("op")
        unpinned, other = [], []
        for p in pages:
            ops = tier.pins.get(p)
            if not ops:
                unpinned.append(p)
                continue
            if op in ops:
                ops.remove(op)
            else:
                other.append((p, list(ops)))
                ops.pop()
            if not ops:
                del tier.pins[p]
        if unpinned:
            self._problem(seq, "unpin", tname, unpinned[0], "bad_unpin", f"unpin (op {op}) of a page nobody pins", len(unpinned))
        if other:
            p, ops = other[0]
            self._problem(seq, "unpin", tname, p, "bad_unpin", f"unpin by op {op} of a page pinned only by op(s) {ops}", len(other))

    # -- copy events: the pages they name must be owned (and pinned by the copy) -----------
    def _on_backup(self, seq, tname, tier, pages, owner, record) -> None:
        self._check_copy(seq, "backup", tname, tier, pages, record, expect_node=True)

    def _on_load(self, seq, tname, tier, pages, owner, record) -> None:
        self._check_copy(seq, "load", tname, tier, pages, record, expect_node=False)

    def _on_offload(self, seq, tname, tier, pages, owner, record) -> None:
        self._check_copy(seq, "offload", tname, tier, pages, record, expect_node=False)

    def _check_copy(self, seq, event, tname, tier, pages, record, *, expect_node: bool) -> None:
        op = record.get("op")
        node = record.get("node")
        want = None if not expect_node or node is None else f"node:{node}"
        free_, cross, unpinned = [], [], []
        for p in pages:
            prev = tier.owner.get(p)
            if prev is None:
                free_.append(p)
            elif want is not None and prev != want:
                cross.append((p, prev))
            if op is not None and op not in tier.pins.get(p, ()):
                unpinned.append(p)
        if free_:
            self._problem(seq, event, tname, free_[0], "use_after_free", f"{event} (op {op}) names a free page", len(free_))
        if cross:
            p, prev = cross[0]
            self._problem(seq, event, tname, p, "cross_owner", f"{event} (op {op}) for {want} of a page {prev} owns", len(cross))
        if unpinned:
            self._problem(seq, event, tname, unpinned[0], "use_after_free",
                          f"{event} (op {op}) of a page its copy does not pin", len(unpinned))

    # -- output --------------------------------------------------------------------------
    def _problem(self, seq, event, tier, page, kind, detail, pages: int = 1, line: int | None = None) -> None:
        self.report.problems.append(Problem(seq, event, tier, page, kind, detail, pages, line))

    def _end_run(self) -> None:
        """Leaks and pins left at the end of a run; then the state is captured and reset."""
        live = self.live_owners
        rep = self.report
        rep.owners, rep.pins, rep.cached = {}, {}, {}
        for tname, tier in self._tiers.items():
            leaked: dict[str, list[int]] = {}
            cached = 0
            for p, o in tier.owner.items():
                if _owned_by_live(o, live):
                    cached += 1
                else:
                    leaked.setdefault(o, []).append(p)
            for o, ps in leaked.items():
                self._problem(None, "end", tname, min(ps), "leak", f"{len(ps)} page(s) still owned by {o}", len(ps))
            by_op: dict[Any, list[int]] = {}
            for p, ops in tier.pins.items():
                for op in ops:
                    by_op.setdefault(op, []).append(p)
            for op, ps in by_op.items():
                self._problem(None, "end", tname, min(ps), "pin_leak", f"{len(ps)} page(s) still pinned by op {op}", len(ps))
            rep.owners[tname] = dict(sorted(tier.owner.items()))
            rep.pins[tname] = {p: len(ops) for p, ops in sorted(tier.pins.items()) if ops}
            rep.cached[tname] = cached
        self._tiers = {}

    def finish(self, expected: Any = None) -> AuditReport:
        """End the replay; with ``expected`` (ledger snapshots), also compare the final state."""
        if not self._finished:
            self._finished = True
            self._end_run()
            if expected is not None:
                for diff in compare_final_state(self.report, expected):
                    self._problem(None, "end", None, None, "state_mismatch", diff)
        return self.report


def read_events(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            yield n, text


def audit(path: str, *, live_owners: Iterable[str] = DEFAULT_LIVE_OWNERS, expected: Any = None) -> AuditReport:
    """Replay the JSONL trace at ``path``; see `TraceAuditor`. ``expected``: ledger snapshots the
    final state must equal (``LedgerSnapshot``s, or a mapping tier -> snapshot)."""
    auditor = TraceAuditor(live_owners=live_owners, path=str(path))
    for n, text in read_events(path):
        auditor.feed_line(text, line=n)
    return auditor.finish(expected)


def audit_events(events: Iterable[Mapping[str, Any]], *, live_owners: Iterable[str] = DEFAULT_LIVE_OWNERS,
                 expected: Any = None) -> AuditReport:
    """The same replay over in-memory event dicts (tests, an in-process sink)."""
    auditor = TraceAuditor(live_owners=live_owners)
    for record in events:
        auditor.feed(record)
    return auditor.finish(expected)


def _snapshots_by_tier(snapshots: Any) -> dict[str, Any]:
    items = snapshots.values() if isinstance(snapshots, Mapping) else snapshots
    out: dict[str, Any] = {}
    for snap in items:
        if snap is None:
            continue
        tier = getattr(snap.tier, "value", snap.tier)
        out[str(tier)] = snap
    return out


def compare_final_state(report: AuditReport, snapshots: Any) -> list[str]:
    """Differences between the replayed final state and live ledger snapshots (empty = equal).

    ``snapshots``: `runtime.memory.ledger.LedgerSnapshot`s (or a mapping tier -> snapshot;
    None entries are skipped). Per page, the owner (as its trace string) and the pin count
    must agree; a tier the trace never mentions must be all free and unpinned.
    """
    diffs: list[str] = []
    for tier, snap in _snapshots_by_tier(snapshots).items():
        replay_owner = report.owners.get(tier, {})
        replay_pins = report.pins.get(tier, {})
        codes = np.asarray(snap.page_codes)
        pins = np.asarray(snap.pins)
        live_owner = {int(p): str(snap.owners[int(codes[p])]) for p in np.flatnonzero(codes).tolist()}
        live_pins = {int(p): int(pins[p]) for p in np.flatnonzero(pins).tolist()}
        for name, replayed, live in (("owner", replay_owner, live_owner), ("pins", replay_pins, live_pins)):
            bad = sorted(p for p in set(replayed) | set(live) if replayed.get(p) != live.get(p))
            if bad:
                shown = ", ".join(f"page {p}: trace {replayed.get(p)!r} ledger {live.get(p)!r}" for p in bad[:5])
                more = f", ... {len(bad) - 5} more" if len(bad) > 5 else ""
                diffs.append(f"{tier} {name} differs at {len(bad)} page(s): {shown}{more}")
    return diffs


# -- CLI: python -m runtime.audit FILE --------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.audit",
                                description="Replay a JSONL slot-lifecycle trace and report use-after-free, double free, "
                                            "free while pinned, cross-owner use and leaks. Exit 0 when clean, 1 otherwise.")
    p.add_argument("file", help="JSONL trace written with RuntimeConfig(trace_path=...)")
    p.add_argument("--allow-live", metavar="OWNER_PREFIX", action="append", default=None,
                   help="owner prefix whose pages may stay owned at the end (reported as cached, not leaked); "
                        f"repeatable, added to the default {' '.join(DEFAULT_LIVE_OWNERS)}")
    p.add_argument("--strict", action="store_true",
                   help="drop the default: only --allow-live owners may keep pages at the end (e.g. after a flush)")
    p.add_argument("--max-problems", type=int, default=20, metavar="N", help="problems listed in full (default 20)")
    p.add_argument("--json", action="store_true", help="print the problems as JSON lines instead of a summary")
    args = p.parse_args(argv)
    live = (() if args.strict else DEFAULT_LIVE_OWNERS) + tuple(args.allow_live or ())
    try:
        report = audit(args.file, live_owners=live)
    except OSError as exc:
        print(f"cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        from dataclasses import asdict

        for prob in report.problems:
            print(json.dumps(asdict(prob)))
    else:
        print(report.summary(args.max_problems))
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
