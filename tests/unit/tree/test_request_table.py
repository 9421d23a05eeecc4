"""Unit tests of `RequestTable` (runtime/tree/request_table.py): rows, page maps, the batch
operations of a decode step, and the private copy a removed record keeps.

Checked to fail: with `detach` leaving the record on its row (no private copy),
`test_a_removed_record_keeps_its_slots_when_its_row_is_reused` fails; with `advance` reading
position seq_len - 1, `test_advance_matches_per_request_reads` fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.memory.owners import Owner
from runtime.tree.records import RequestRecord
from runtime.tree.request_table import RequestTable


def record(rid: str) -> RequestRecord:
    return RequestRecord(rid, 1, Owner.request(rid, 1), None, np.zeros(1, np.int32), 0, None, 1)


def page_slots(pages, ps):
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * ps + np.arange(ps)).reshape(-1)


@pytest.mark.parametrize("ps", [1, 4])
def test_a_record_reads_and_writes_its_row(ps):
    t = RequestTable(ps, rows=2, width=1)
    rec = record("a")
    t.add(rec, page_slots([5, 2], ps), seq_len=2 * ps - 1, committed=ps)
    assert rec.slots.tolist() == page_slots([5, 2], ps).tolist() and rec.num_slots == 2 * ps
    assert (rec.seq_len, rec.committed_len) == (2 * ps - 1, ps)
    assert rec.slot_range(1, ps + 1).tolist() == page_slots([5, 2], ps)[1:ps + 1].tolist()
    rec.append_slots(page_slots([9], ps))  # grows the width
    assert rec.slots.tolist() == page_slots([5, 2, 9], ps).tolist()
    rec.truncate_slots(ps)
    assert rec.slots.tolist() == page_slots([5], ps).tolist()
    rec.seq_len, rec.committed_len = 1, 0
    assert (int(t.seq_len[rec.row]), int(t.committed[rec.row])) == (1, 0)
    assert t.record_at[rec.row] is rec and t.row_of("a") == rec.row


def test_slots_are_copies():
    t = RequestTable(1)
    rec = record("a")
    t.add(rec, np.array([3, 4], dtype=np.int64), 2, 2)
    view = rec.slots
    view[0] = 99
    assert rec.slots.tolist() == [3, 4]


def test_a_removed_record_keeps_its_slots_when_its_row_is_reused():
    t = RequestTable(2, rows=1)
    a, b = record("a"), record("b")
    t.add(a, page_slots([1, 2], 2), 3, 3)
    row = a.row
    t.detach(a)
    t.add(b, page_slots([7], 2), 1, 0)
    assert b.row == row  # the row was reused...
    assert a.slots.tolist() == page_slots([1, 2], 2).tolist() and (a.seq_len, a.committed_len) == (3, 3)
    assert "a" not in t.records and t.row_of("a") is None


def test_rows_grow_and_are_reused():
    t = RequestTable(1, rows=1)
    recs = [record(f"r{i}") for i in range(5)]
    for i, rec in enumerate(recs):
        t.add(rec, np.array([i], dtype=np.int64), 1, 1)
    assert sorted(t.live_rows().values()) == [0, 1, 2, 3, 4] and len(t.seq_len) == 8
    t.detach(recs[2])
    t.remove(recs[3])
    assert recs[2].row == 0 and recs[3].table is None and len(t.free_rows()) == 5
    assert [r.slots.tolist() for r in recs if r.table is not None] == [[0], [1], [2], [4]]


def test_rows_of_and_repeats():
    t = RequestTable(1)
    for rid in "abc":
        t.add(record(rid), np.array([0], dtype=np.int64), 1, 1)
    rows = t.rows_of(("c", "a"))
    assert rows.tolist() == [t.row_of("c"), t.row_of("a")]
    assert t.rows_of(()).tolist() == [] and t.rows_of(("b",)).tolist() == [t.row_of("b")]
    assert not t.has_repeats(rows) and t.has_repeats(t.rows_of(("a", "b", "a")))
    with pytest.raises(KeyError):
        t.rows_of(("a", "zz"))
    with pytest.raises(TypeError):
        t.rows_of(("a", ["unhashable"]))


def test_batch_rows_are_reused_only_while_no_row_is_freed():
    """Checked failing with `_free` not dropping the last batch: the stale rows of a removed
    request come back instead of a KeyError, and a re-added rid reads its old row."""
    t = RequestTable(1)
    recs = {rid: record(rid) for rid in "abc"}
    for rec in recs.values():
        t.add(rec, np.array([0], dtype=np.int64), 1, 1)
    rows = t.batch_rows(("c", "a"))
    assert rows.tolist() == [t.row_of("c"), t.row_of("a")] and not rows.flags.writeable
    assert t.batch_rows(("c", "a")) is rows  # the same batch: no lookup
    t.add(record("d"), np.array([0], dtype=np.int64), 1, 1)  # an added row moves no other
    assert t.batch_rows(("c", "a")) is rows
    with pytest.raises(ValueError):
        t.batch_rows(("a", "b", "a"))
    t.remove(recs["a"])
    with pytest.raises(KeyError):
        t.batch_rows(("c", "a"))
    t.remove(recs["b"])
    t.add(record("a"), np.array([0], dtype=np.int64), 1, 1)  # "a" again, in another row
    assert t.batch_rows(("c", "a")).tolist() == [t.row_of("c"), t.row_of("a")]


@pytest.mark.parametrize("ps", [1, 4])
def test_advance_matches_per_request_reads(ps):
    """A batch step: rows that start a page get one, every row gets the slot at its seq_len."""
    rng = np.random.default_rng(ps)
    t = RequestTable(ps)
    recs = []
    free = list(rng.permutation(200))
    for i in range(12):
        n_pages = int(rng.integers(1, 5))
        seq = int(rng.integers((n_pages - 1) * ps + 1, n_pages * ps + 1))
        rec = record(f"r{i}")
        t.add(rec, page_slots([free.pop() for _ in range(n_pages)], ps), seq, seq - 1)
        recs.append(rec)
    for _ in range(3 * ps):
        rows = t.rows_of(tuple(r.rid for r in recs))
        seq = t.seq_len[rows]
        starting = rows[seq >= t.num_slots[rows]]
        assert sorted(starting.tolist()) == sorted(r.row for r in recs if r.seq_len == r.num_slots)
        t.append_page_each(starting, page_slots([free.pop() for _ in starting], ps))
        expect = [int(r.slots[r.seq_len]) for r in recs]
        lens = [r.seq_len for r in recs]
        assert t.advance(rows, seq).tolist() == expect
        assert [r.committed_len for r in recs] == lens and [r.seq_len for r in recs] == [n + 1 for n in lens]
