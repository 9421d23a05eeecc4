"""Null objects: an optional tier or feature that is off.

The core calls its parts the same way whether a tier is on or not: KV events off record nothing
(`NoEvents`), no storage tier writes, looks up and holds nothing (`NoStorage`), no decode
offload retires no request (`NoOffload`). The host tier off is a host ledger of no pages (the
residency's), the storage tier's snapshot store without recurrent state `NoSnapshots`
(`runtime/tree/groups/recurrent.py`). A call that needs the tier on (an ack of a storage op, an
offload actor's call) is the runtime's own bug here: an `InternalError`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import InternalError
from runtime.tree.nodes import Node
from runtime.tree.records import Prefetch, RequestRecord, StoredPages

if TYPE_CHECKING:
    from runtime.tree.tiers.storage import StorageRequest

__all__ = ["NoEvents", "NoStorage", "NoOffload"]


class NoEvents:
    """KV events off: every tier change is reported to nothing."""

    pending: tuple[()] = ()

    def stored(self, node: Node, medium: str, num_tokens: int | None = None) -> None:
        pass

    def removed(self, node: Node, medium: str) -> None:
        pass

    def stored_pages(self, hashes: list[bytes], parent: bytes | None, tokens: np.ndarray,
                     extra_key: Hashable, medium: str) -> None:
        pass

    def removed_pages(self, hashes: list[bytes], medium: str) -> None:
        pass

    def mark(self) -> int:
        return 0

    def cleared_since(self, mark: int) -> None:
        pass

    def take(self) -> list[Any]:
        return []


class NoStorage:
    """No storage tier attached: nothing written, prepared or in flight."""

    attached = False
    paused = False
    may_wait = False
    ops: dict[int, Any] = {}  # (read-only: never filled)
    prefetches: dict[Hashable, Prefetch] = {}
    prefetched: frozenset[Hashable] = frozenset()
    prefetch_landed: dict[Hashable, int] = {}
    known: frozenset[bytes] = frozenset()

    def pause(self, paused: bool) -> None:
        pass

    def write(self, node: Node, length: int, host: np.ndarray) -> None:
        pass

    def write_chain(self, node: Node, length: int) -> None:
        pass

    def prepare(self, rid: Hashable, tokens: np.ndarray, extra_key: Hashable) -> int:
        return 0


    def admitted(self, rid: Hashable, host_len: int) -> int:
        return 0

    def cancel(self, rid: Hashable) -> Prefetch | None:
        return None

    def forget(self, rid: Hashable) -> bool:
        return False

    def detach(self, pf: Prefetch) -> None:
        pass

    def mark_overdue(self, op_id: int) -> Prefetch | None:
        return None

    def mark_down(self, down: bool) -> None:
        pass

    def all_overdue(self) -> bool:
        return True

    # (C-level: an off tier costs no Python frame on the turn's path)
    take_requests: Callable[[], list["StorageRequest"]] = staticmethod(list)

    def apply_ack(self, op_id: int, *args: Any) -> Prefetch | None:
        raise InternalError(f"ack of storage op {op_id} without a storage tier")

    def kept(self) -> StoredPages:
        raise InternalError("storage detached without a storage tier")

    def forget_stored(self) -> list[bytes]:
        raise InternalError("storage clear without a storage tier")


class NoOffload:
    """Decode offload off: a released request's device pages are freed at once, none is retired."""

    ops: dict[int, Any] = {}  # (read-only: never filled)
    retired: dict[Any, Any] = {}
    landed: dict[Any, Any] = {}
    inflight: dict[Any, Any] = {}

    def __init__(self, counters: tuple[str, ...]) -> None:
        """`counters`: decode offload's counter names (reported as 0)."""
        self.stats: dict[str, int] = dict.fromkeys(counters, 0)

    retires = False  # a released request's device pages are freed at once (`DecodeOffload.retires`)

    def note_commits(self, recs: Iterable[RequestRecord]) -> None:
        pass

    def check_rewind(self, rec: RequestRecord, new_len: int) -> None:
        pass

    # (C-level: an off feature costs no Python frame on the turn's path)
    take_plans: Callable[[], list[Any]] = staticmethod(list)
    take_notes: Callable[[], list[Any]] = staticmethod(list)

    def counts(self) -> dict[str, int]:
        return {"inflight_offloads": 0, "offload_retired_requests": 0}

    def retire(self, rec: RequestRecord, final_len: int | None) -> None:
        raise InternalError("a request retired without decode offload")

    def retired_record(self, rid: Hashable, generation: int) -> None:
        return None

    def start(self, rid: Hashable, generation: int, start: int, end: int, live: RequestRecord | None) -> Any:
        raise InternalError("offload start without decode offload")

    def release(self, rid: Hashable, generation: int, busy: Any) -> Any:
        raise InternalError("offload release without decode offload")

    def apply_ack(self, op_id: int, error: str | None) -> None:
        raise InternalError(f"offload ack of op {op_id} without decode offload")
