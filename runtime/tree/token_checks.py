"""The token checks of the core's calls: what a caller's token array must be before anything
changes (a `LengthError` or `StateError` means nothing did). Pure functions over a request's
record; `CacheCore` calls them first thing in every call that takes tokens."""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime.errors import LengthError, StateError
from runtime.tree.records import RequestRecord


def checked_tokens(tokens: Any, device_slots: int) -> np.ndarray:
    """`tokens` as an int32 array: non-empty, 1-D, no longer than the device pool."""
    arr = np.asarray(tokens, dtype=np.int32)
    if arr.ndim != 1 or len(arr) == 0:
        raise LengthError("tokens must be a non-empty 1-D sequence of token ids")
    if len(arr) > device_slots:
        raise LengthError(f"{len(arr)} tokens exceed the device pool ({device_slots} slots)")
    return arr


def checked_kv_tokens(rec: RequestRecord, arr: np.ndarray) -> np.ndarray:
    """Checked tokens a request's KV is inserted under: no more than it has slots for, and an
    extension of the tokens it was admitted or cached with (seed 003: a record only grows)."""
    if len(arr) > rec.seq_len:
        raise LengthError(f"{len(arr)} tokens given but request {rec.rid!r} has KV slots for {rec.seq_len}")
    keep = min(len(arr), len(rec.tokens))
    # (a `step`'s Cache shares its Admit's checked prompt array: nothing to compare)
    if keep and arr is not rec.tokens and arr[:keep].tobytes() != rec.tokens[:keep].tobytes():
        raise StateError(f"tokens of {rec.rid!r} do not extend the tokens it was admitted or cached with")
    return arr


def kept_tokens(rec: RequestRecord, arr: np.ndarray, finished_len: int | None, session_kv: int) -> np.ndarray:
    """The tokens a finishing request keeps: prompt + `finished_len` (all when None); a session's
    turn keeps at least the `session_kv` tokens its session had."""
    if finished_len is not None:
        keep = rec.prompt_len + finished_len if isinstance(finished_len, int) and finished_len >= 0 else -1
        if not rec.prompt_len <= keep <= len(arr):
            raise LengthError(f"finished_len {finished_len!r} of {rec.rid!r} must keep between "
                              f"{rec.prompt_len} and {len(arr)} tokens")
        arr = arr[:keep]
    if rec.session is not None and len(arr) < session_kv:
        raise LengthError(f"turn {rec.rid!r} must keep at least the {session_kv} "
                          f"tokens its session {rec.session!r} had, got {len(arr)}")
    return arr
