"""`RequestTable`: the live requests' records, and their lengths and slot maps as arrays.

As SGLang's `req_to_token`, a row maps the request's token positions to device slots
(`slot_map[row, position]`, int32: a device pool never nears 2**31 slots), beside its sequence
and committed lengths, its mapped pages and the ledger code of its owner (held from its
admission, a session turn's from its first decode step, to the row's end, see `SlotLedger.hold`). A decode step over N requests is then a few numpy operations on
these arrays and one ledger call for the requests that start a page, whatever N is; the
per-request calls read and write the same arrays through the record's properties.

Memory: 4 bytes x rows x the longest live request's mapped tokens (both grow by doubling and
are never shrunk), as SGLang sizes `req_to_token` for its longest context up front.

Owns `records` (rid -> RequestRecord), the rid -> row map, the free rows and the arrays. A
record that leaves the table never reads its old row again, so a reused row never changes a
record somebody still holds: a released one (`remove`) reads nothing any more, a retired one
waiting for its offloads (`detach`) reads a private copy of its row.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from runtime.tree.records import RequestRecord

_I64 = np.int64


class RequestTable:
    def __init__(self, page_size: int, rows: int = 64, width: int = 256) -> None:
        self.page_size = page_size
        self.records: dict[Hashable, RequestRecord] = {}
        self._row_of: dict[Hashable, int] = {}
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        # Per-row lengths, each one buffer seen two ways: `seq_len` etc. as numpy arrays for a
        # batch, `seq_len_at` etc. as Python arrays for one row (indexing one costs a fraction
        # of a numpy scalar's).
        self.seq_len_at, self.seq_len = _lengths(rows)  # token positions in use
        self.committed_at, self.committed = _lengths(rows)  # positions whose KV the caller computed
        self.num_slots_at, self.num_slots = _lengths(rows)  # positions mapped: whole pages, >= seq_len
        # device ledger code of the row's owner, held from its admission (a session turn's: from
        # its first decode step; 0: not yet)
        self.codes = np.zeros(rows, dtype=_I64)
        self.record_at: list[RequestRecord | None] = [None] * rows
        self.slot_map = np.zeros((rows, max(width, page_size)), dtype=np.int32)
        self._mark = np.zeros(rows, dtype=_I64)  # scratch: repeated rows in a batch
        # the last batch's rids and rows (read-only), valid until a row is freed: a decode loop
        # steps the same batch again and again
        self._last_batch: tuple[tuple[Hashable, ...], np.ndarray] | None = None

    # -- rows ------------------------------------------------------------------------
    def add(self, rec: RequestRecord, slots: np.ndarray, seq_len: int, committed: int, code: int = 0) -> None:
        """File `rec` under a free row mapping `slots` (whole pages), with its lengths and the
        ledger code its owner is held under (0: none yet)."""
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        n = len(slots)
        if n > self.slot_map.shape[1]:
            self._fit(n)
        self.slot_map[row, :n] = slots
        self.num_slots_at[row] = n
        self.seq_len_at[row] = seq_len
        self.committed_at[row] = committed
        if code:
            self.codes[row] = code
        self.record_at[row] = rec
        rec.table, rec.row = self, row
        self.records[rec.rid] = rec
        self._row_of[rec.rid] = row

    def remove(self, rec: RequestRecord) -> int:
        """Take `rec` out for good (released): it reads no row any more, and its row is free.
        Returns the owner code its row held (0: none)."""
        code = self._free(rec)
        rec.table = None  # a read of a released record fails loudly, never reads a reused row
        return code

    def detach(self, rec: RequestRecord) -> int:
        """Take `rec` out, keeping a private copy of its row (a retired request waiting for its
        offloads still reads its slots); its row is free for reuse. Returns the owner code its
        row held (0: none)."""
        row = self._row_of[rec.rid]
        n = self.num_slots_at[row]
        own = RequestTable(self.page_size, rows=1, width=n)
        own.take_row(self.slot_map[row, :n], self.seq_len_at[row], self.committed_at[row])
        code = self._free(rec)
        rec.table, rec.row = own, 0
        return code

    def take_row(self, slots: np.ndarray, seq_len: int, committed: int) -> None:
        """A one-row table (`detach`'s private copy) takes its row: `slots`, with its lengths."""
        n = len(slots)
        self._free_rows.clear()
        self.slot_map[0, :n] = slots
        self.num_slots_at[0] = n
        self.seq_len_at[0] = seq_len
        self.committed_at[0] = committed

    def hold_codes(self, rows: np.ndarray, hold: Callable[[RequestRecord], int]) -> np.ndarray:
        """The ledger codes of `rows`' owners, holding (`hold(record)`) those not held yet (session
        turns: held from their first decode step)."""
        codes = self.codes[rows]
        if not codes.all():
            for row in rows[codes == 0].tolist():
                self.codes[row] = hold(self.record_at[row])  # type: ignore[arg-type]
            codes = self.codes[rows]
        return codes

    def row_of(self, rid: Hashable) -> int | None:
        return self._row_of.get(rid)

    def live_rows(self) -> dict[Hashable, int]:
        """rid -> row of every live request (a copy: for the invariant checker)."""
        return dict(self._row_of)

    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    # -- one row ---------------------------------------------------------------------
    def append(self, row: int, slots: np.ndarray) -> None:
        """Map `slots` (whole pages) after the row's mapped ones."""
        n = self.num_slots_at[row]
        end = n + len(slots)
        if end > self.slot_map.shape[1]:
            self._fit(end)
        self.slot_map[row, n:end] = slots
        self.num_slots_at[row] = end

    # -- a batch of rows (a decode step) ----------------------------------------------
    def batch_rows(self, rids: tuple[Hashable, ...]) -> np.ndarray:
        """The rows of `rids`, in order, read-only. KeyError or TypeError: one is not live;
        ValueError: one appears twice. The same batch as last time, with no row freed since,
        gets the same rows without a lookup."""
        last = self._last_batch
        if last is not None:
            try:
                same = last[0] == rids
            except Exception:  # a rid with a broken __eq__ is looked up (and fails) below
                same = False
            if same:
                return last[1]
        rows = self.rows_of(rids)
        if self.has_repeats(rows):
            raise ValueError("a request appears twice")
        rows.flags.writeable = False
        self._last_batch = (rids, rows)
        return rows

    def rows_of(self, rids: Sequence[Hashable]) -> np.ndarray:
        """The rows of `rids`, in order (KeyError or TypeError: one is not live)."""
        if len(rids) <= 1:
            return np.array([self._row_of[rid] for rid in rids], dtype=_I64)
        return np.fromiter(itemgetter(*rids)(self._row_of), dtype=_I64, count=len(rids))

    def has_repeats(self, rows: np.ndarray) -> bool:
        """Whether a row appears twice: O(len(rows)), no sort."""
        mark = self._mark
        order = np.arange(len(rows), dtype=_I64)
        mark[rows] = order
        return bool((mark[rows] != order).any())

    def append_page_each(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """Map page i of `slots` (page_size slots each) after the mapped slots of `rows[i]`
        (rows distinct)."""
        n = self.num_slots[rows]
        ps = self.page_size
        top = int(n.max()) + ps
        if top > self.slot_map.shape[1]:
            self._fit(top)
        if ps == 1:
            self.slot_map[rows, n] = slots
        else:
            self.slot_map[rows[:, None], n[:, None] + np.arange(ps)] = slots.reshape(-1, ps)
        self.num_slots[rows] = n + ps

    def advance(self, rows: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Commit every token of `rows` (`seq`: their seq_len) and give each the slot of one
        more (already mapped)."""
        out = self.slot_map[rows, seq].astype(_I64)
        self.committed[rows] = seq
        self.seq_len[rows] = seq + 1
        return out

    # -- helpers -----------------------------------------------------------------------
    def _free(self, rec: RequestRecord) -> int:
        row = self._row_of.pop(rec.rid)
        self._last_batch = None
        del self.records[rec.rid]
        self.num_slots_at[row] = self.seq_len_at[row] = self.committed_at[row] = 0
        code = self.codes.item(row)
        self.codes[row] = 0
        self.record_at[row] = None
        self._free_rows.append(row)
        return code

    def _fit(self, width: int) -> None:
        have = self.slot_map.shape[1]
        grown = np.zeros((self.slot_map.shape[0], max(width, 2 * have)), dtype=np.int32)
        grown[:, :have] = self.slot_map
        self.slot_map = grown

    def _grow_rows(self) -> None:
        old = len(self.seq_len)
        new = 2 * old
        self.seq_len_at, self.seq_len = _lengths(new, self.seq_len_at)
        self.committed_at, self.committed = _lengths(new, self.committed_at)
        self.num_slots_at, self.num_slots = _lengths(new, self.num_slots_at)
        self.codes = _grown(self.codes, new)
        self.record_at.extend([None] * (new - old))
        self._mark = _grown(self._mark, new)
        self.slot_map = _grown(self.slot_map, new)
        self._free_rows.extend(range(new - 1, old - 1, -1))


def _lengths(rows: int, old: array | None = None) -> tuple[array, np.ndarray]:
    """A Python int64 array of `rows` zeros (holding `old` first) and a numpy view of it."""
    buf = array("q", bytes(8 * rows))
    if old is not None:
        buf[: len(old)] = old
    return buf, np.frombuffer(buf, dtype=_I64)


def _grown(arr: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[: len(arr)] = arr
    return out
