"""StorageThenPeer: a decode runtime's storage tier and its prefill peer behind one backend.

A decode runtime matches a prompt against its device and host tiers; beyond that hit its storage
tier asks this backend, which answers from the storage backend first (pages stored there: by this
runtime's own write-through, or by another instance sharing it) and from the prefill peer
(`PeerBackend`) for the pages after them: the peer is asked only for what no tier of the decode
side holds. Writes go to the storage backend, and so do the pages the peer wrote (with their
tags): the storage tier takes every page it read for stored. Both must agree on the page size.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from runtime.errors import ConfigError
from runtime.storage.backend import Buffer, checked_count, checked_flags, leading_hits
from runtime.trace import get_logger

_log = get_logger("hicache.disagg")

__all__ = ["StorageThenPeer"]


class StorageThenPeer:
    read_only = False  # writes go to the storage backend

    def __init__(self, storage: Any, peer: Any) -> None:
        if storage.page_bytes != peer.page_bytes:
            raise ConfigError(f"the storage backend's pages are {storage.page_bytes} bytes, the peer's {peer.page_bytes}")
        self.storage = storage
        self.peer = peer
        self.page_bytes = peer.page_bytes
        # (the lookup is local only when both parts' are)
        self.exists_is_local = getattr(storage, "exists_is_local", False) is True

    def expect(self, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> int:
        return self.peer.expect(tokens, extra_key)

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        n = checked_count("exists_prefix", self.storage.exists_prefix(keys), len(keys))
        return n if n == len(keys) else n + self.peer.exists_prefix(keys[n:])

    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer], tags: list[bytes | None] | None = None) -> int:
        """The leading pages storage holds, then the peer's from there on (tags of both)."""
        tags = tags if tags is not None else [None] * len(keys)
        n = self._from_storage(keys, dests, tags)
        if n == len(keys):
            return n
        rest: list[bytes | None] = [None] * (len(keys) - n)
        m = self.peer.get_prefix(keys[n:], dests[n:], rest)
        tags[n:n + m] = rest[:m]
        if m:  # the storage tier takes pages it read for stored (it writes none of them): store them
            try:
                self.storage.set_batch(keys[n:n + m], dests[n:n + m], rest[:m])
            except Exception as exc:  # noqa: BLE001 - not stored: a later lookup finds them missing, rewritten
                _log.debug("peer_pages_not_stored", pages=m, error=repr(exc))
        return n + m

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        n = self.get_prefix(keys, dests, tags)
        return [i < n for i in range(len(keys))]

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer], tags: Sequence[bytes] | None = None) -> list[bool]:
        return self.storage.set_batch(keys, srcs, tags)

    def register_buffer(self, buffer: Any) -> None:
        self.peer.register_buffer(buffer)
        register = getattr(self.storage, "register_buffer", None)
        if register is not None:
            register(buffer)

    def unregister_buffer(self, buffer: Any) -> None:
        self.peer.unregister_buffer(buffer)
        unregister = getattr(self.storage, "unregister_buffer", None)
        if unregister is not None:
            unregister(buffer)

    def close(self) -> None:
        try:
            self.storage.close()
        finally:
            self.peer.close()

    def stats(self) -> dict[str, Any]:
        return {"backend": "storage_then_peer", "storage": self.storage.stats(), "peer": self.peer.stats()}

    def _from_storage(self, keys: Sequence[bytes], dests: Sequence[Buffer], tags: list[bytes | None]) -> int:
        get_prefix = getattr(self.storage, "get_prefix", None)
        if get_prefix is not None:
            return checked_count("get_prefix", get_prefix(keys, dests, tags), len(keys))
        n = checked_count("exists_prefix", self.storage.exists_prefix(keys), len(keys))
        if n == 0:
            return 0
        return leading_hits(checked_flags("get_batch", self.storage.get_batch(keys[:n], dests[:n], tags), n))
