"""`PrefixIndex`: which instance holds which page on which medium, rebuilt from KV events alone.

What a cache-aware router keeps (as NVIDIA Dynamo's KV router and llm-d's KV cache manager do):
per instance, the set of page hashes resident on each medium. A request's page hashes (the same
chain every instance computes: `runtime.storage.hashing.page_hashes`) then give, per instance,
the cached prefix per tier as `match_prefix` counts it: device pages are the leading run on GPU,
host pages the run on CPU right after them. Storage shared by the fleet (one L3) is one set for
everybody: a page any instance wrote can be read by every instance.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .wire import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Pages of a request's prefix an instance holds: on device, then host, then storage."""

    device: int
    host: int
    storage: int

    @property
    def pages(self) -> int:
        return self.device + self.host + self.storage


class PrefixIndex:
    # -- state -------------------------------------------------------------------
    def __init__(self, *, shared_storage: bool = True) -> None:
        self.shared_storage = shared_storage
        self._pages: dict[Hashable, dict[str, set[bytes]]] = {}  # instance -> medium -> page hashes
        self._storage: set[bytes] = set()  # shared storage (shared_storage=True)
        self.batches_applied = 0

    # -- events ------------------------------------------------------------------
    def apply(self, instance: Hashable, batch: KVEventBatch) -> None:
        """Apply one batch of `instance`'s events (batches of one instance in sequence order)."""
        tiers = self._pages.get(instance)
        if tiers is None:
            tiers = self._pages[instance] = {GPU: set(), CPU: set(), STORAGE: set()}
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                self._set(tiers, event.medium).update(event.block_hashes)
            elif kind is BlockRemoved:
                self._set(tiers, event.medium).difference_update(event.block_hashes)
            elif kind is AllBlocksCleared:  # the instance's device and host tiers are empty
                tiers[GPU].clear()
                tiers[CPU].clear()
        self.batches_applied += 1

    def forget(self, instance: Hashable) -> None:
        """An instance left (or its event stream broke): nothing of it is known any more."""
        self._pages.pop(instance, None)

    # -- questions ------------------------------------------------------------------
    def instances(self) -> list[Hashable]:
        return list(self._pages)

    def pages(self, instance: Hashable, medium: str) -> frozenset[bytes]:
        tiers = self._pages.get(instance)
        if tiers is None:
            return frozenset()
        return frozenset(self._set(tiers, medium))

    def match(self, instance: Hashable, hashes: Sequence[bytes]) -> PrefixHit:
        """The cached prefix of a request with page hashes `hashes` at `instance`."""
        tiers = self._pages.get(instance)
        if tiers is None:
            return PrefixHit(0, 0, self._run(self._storage, hashes, 0) if self.shared_storage else 0)
        device = self._run(tiers[GPU], hashes, 0)
        host = self._run(tiers[CPU], hashes, device) - device
        storage_set = self._storage if self.shared_storage else tiers[STORAGE]
        storage = self._run(storage_set, hashes, device + host) - device - host
        return PrefixHit(device, host, storage)

    # -- helpers -----------------------------------------------------------------------
    def _set(self, tiers: dict[str, set[bytes]], medium: str | None) -> set[bytes]:
        if medium == STORAGE and self.shared_storage:
            return self._storage
        return tiers[medium or GPU]

    @staticmethod
    def _run(pages: set[bytes], hashes: Sequence[bytes], start: int) -> int:
        """The end of the run of `hashes` held in `pages` from `start` on."""
        i = start
        n = len(hashes)
        while i < n and hashes[i] in pages:
            i += 1
        return i


__all__ = ["PrefixIndex", "PrefixHit"]
