"""`MooncakeBackend`: pages in a Mooncake Store cluster (``MooncakeDistributedStore``).

Every serving process is a Mooncake *client*: it may contribute memory to the distributed
pool (``global_segment_size``) and reads and writes objects by key; a ``mooncake_master``
allocates space and keeps the object index; a metadata service (the standalone
``mooncake_http_metadata_server``, etcd, or ``P2PHANDSHAKE``) lets transfer engines find
each other. Objects are immutable once written and evicted (approximately LRU) by the master
when the pool fills, so presence is a hint.

Keys are ``key_prefix + page_hash.hex()``; values are exactly ``page_bytes`` bytes. Each page
has a companion object ``<page key>/tag``: the page's tag (16 bytes), which the storage tier
computed from the host pool's bytes and checks against the bytes it reads
(`runtime.storage.integrity`), as in the file backend's trailer. A companion key and not a
trailer in the page object: a page object read straight into the registered host pool must be
exactly one pool page long. The page is written first, its tag second, and a read fetches the
tags of the pages it read (one more small ``get_batch`` per read), so a page without a tag
(being written, evicted apart, or written by an older version) is a miss.

Data paths:
- *zero-copy*: a buffer that lies inside memory registered with `register_buffer` (the host
  pool's page-first tensor, say) goes straight to ``batch_put_from`` / ``batch_get_into``;
- otherwise: ``put_batch`` from the caller's buffers; reads go through the backend's own
  registered staging buffer (``batch_get_into`` + one copy), or, while another thread holds
  the staging buffer, ``get_batch`` to bytes + one copy. (Mooncake's ``*_from``/``*_into`` must never see
  unregistered memory: ``batch_put_from`` from an unregistered address corrupts the heap.)

`LocalMooncakeCluster` (`runtime.storage.mooncake_cluster`) starts a master and a metadata server on
127.0.0.1 (tests, benchmarks, a single-machine deployment); `MooncakeConfig`
(`runtime.storage.mooncake_config`) says how to reach a cluster. See docs/STORAGE.md for pointing
the backend at a real cluster.
"""

from __future__ import annotations

import atexit
import bisect
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from runtime.errors import ConfigError
from runtime.storage.backend import (
    Buffer,
    CallGate,
    StorageError,
    buffer_address,
    byte_view,
    check_batch,
    check_keys,
    check_tags,
    gated,
    leading_hits,
)
from runtime.storage.integrity import TAG_BYTES
from runtime.storage.mooncake_buffers import RegisteredBuffers, StagingBuffer
from runtime.storage.mooncake_config import INSTALL_HINT, MooncakeConfig
from runtime.trace import get_logger

_log = get_logger("hicache.storage.mooncake")

MASTER_PROBE_S = 0.5  # a master that accepts no connection within this long is gone (teardown at exit)
TAG_SUFFIX = "/tag"  # companion object of a page: its tag (the storage tier's, TAG_BYTES)
def _import_store() -> Any:
    try:
        from mooncake import store  # noqa: PLC0415
    except ImportError as exc:
        raise StorageError(f"Mooncake is not installed ({exc}); {INSTALL_HINT}") from exc
    return store


class MooncakeBackend:
    """Pages in Mooncake Store. Synchronous, thread-safe (the Mooncake client is)."""

    def __init__(self, page_bytes: int, config: MooncakeConfig, *, staging_bytes: int = 64 << 20) -> None:
        """``staging_bytes``: a registered buffer (whole pages, at least one) through which reads into
        unregistered destinations go; 0 disables it (then Mooncake's ``get_batch`` is used)."""
        if not isinstance(page_bytes, int) or isinstance(page_bytes, bool) or page_bytes <= 0:
            raise ConfigError(f"page_bytes must be a positive int, got {page_bytes!r}")
        self.page_bytes = page_bytes
        self.config = config
        mstore = _import_store()
        if config.protocol == "tcp":
            os.environ.setdefault("MC_FORCE_TCP", "true")
        if config.tcp_bind_address:
            os.environ["MC_TCP_BIND_ADDRESS"] = config.tcp_bind_address
        for k, v in config.env.items():
            os.environ[k] = str(v)
        self._store = mstore.MooncakeDistributedStore()
        rc = self._store.setup(config.local_hostname, config.metadata_server, config.global_segment_size,
                               config.local_buffer_size, config.protocol, config.device_name,
                               config.master_server_address)
        if rc != 0:
            raise StorageError(f"MooncakeDistributedStore.setup failed ({rc}): master {config.master_server_address}, "
                               f"metadata {config.metadata_server}, local {config.local_hostname}")
        self._rconf = mstore.ReplicateConfig()
        self._rconf.replica_num = config.replica_num
        self._prefix = config.key_prefix
        self._registered = RegisteredBuffers(self._store)
        self._gate = CallGate("MooncakeBackend")
        self._teardown_deferred = False  # the master was gone at close: torn down at process exit
        self._staging = StagingBuffer(self._store, page_bytes, staging_bytes)
        self._slock = threading.Lock()
        self._s: dict[str, int] = dict.fromkeys((
            "exists_calls", "get_calls", "set_calls", "pages_read", "read_misses", "pages_written",
            "write_failures", "zero_copy_pages_read", "zero_copy_pages_written", "bytes_read", "bytes_written",
            "errors", "removed_pages"), 0)

    # -- registration --------------------------------------------------------------------------
    @gated
    def register_buffer(self, buf: Buffer) -> None:
        """Register a contiguous CPU buffer (e.g. the host pool's page-first tensor) for zero-copy
        I/O. Pages whose buffers lie inside it skip the copies. Keep ``buf`` alive; the backend
        holds a reference until `unregister_buffer` or `close`."""
        addr, n = buffer_address(buf), _nbytes(buf)
        if n <= 0:
            raise ConfigError("cannot register an empty buffer")
        self._registered.add(buf, addr, n)

    @gated
    def unregister_buffer(self, buf: Buffer) -> None:
        self._registered.remove(buffer_address(buf))

    def _split(self, bufs: Sequence[Buffer], writable: bool) -> tuple[list[int], list[int], list[int]]:
        """Indices and addresses of the buffers inside registered memory (zero-copy), and the
        indices of the others. Validates every buffer (size, contiguity, CPU, writability)."""
        pb = self.page_bytes
        starts, ends = self._registered.ranges()
        zc_i: list[int] = []
        zc_a: list[int] = []
        plain: list[int] = []
        for i, buf in enumerate(bufs):
            if isinstance(buf, torch.Tensor):  # fast path: no memoryview needed
                if not buf.is_cpu or not buf.is_contiguous() or buf.nbytes != pb:
                    byte_view(buf, pb, writable=writable)  # raises the precise ValidationError
                addr = buf.data_ptr()
            elif (isinstance(buf, np.ndarray) and buf.nbytes == pb and buf.flags.c_contiguous
                  and (buf.flags.writeable or not writable)):  # fast path: rows of a page-first pool
                addr = buf.ctypes.data
            else:
                byte_view(buf, pb, writable=writable)
                addr = buffer_address(buf)
            k = bisect.bisect_right(starts, addr) - 1
            if k >= 0 and addr + pb <= ends[k]:
                zc_i.append(i)
                zc_a.append(addr)
            else:
                plain.append(i)
        return zc_i, zc_a, plain

    # -- helpers -------------------------------------------------------------------------------
    def _keys(self, keys: Sequence[bytes]) -> list[str]:
        p = self._prefix
        return [p + bytes(k).hex() for k in keys]

    def _count(self, **inc: int) -> None:
        with self._slock:
            for k, v in inc.items():
                self._s[k] += v

    def _error(self, op: str, exc: BaseException | int) -> None:
        self._count(errors=1)
        _log.warning("mooncake_error", op=op, error=str(exc))

    # -- protocol ------------------------------------------------------------------------------
    @gated
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._count(exists_calls=1)
        if not keys:
            return 0
        try:
            res = self._store.batch_is_exist(self._keys(keys))
        except Exception as exc:  # noqa: BLE001 - a transport error: the call failed (not a miss)
            self._error("batch_is_exist", exc)
            raise StorageError(f"Mooncake batch_is_exist failed: {exc}") from exc
        n = 0
        for r in res:
            if r != 1:
                if r < 0:  # (0: absent; below 0: the master did not answer, e.g. it is down)
                    self._error("batch_is_exist", r)
                    if n == 0:
                        raise StorageError(f"Mooncake batch_is_exist failed: error {r}")
                break
            n += 1
        return n

    @gated
    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        check_batch(keys, dests, "get_batch")
        zc_i, zc_a, plain = self._split(dests, writable=True)
        skeys = self._keys(keys)
        pb = self.page_bytes
        out = [False] * len(keys)
        if zc_i:
            self._get_into([skeys[i] for i in zc_i], zc_a, zc_i, out)
        if plain:
            self._get_plain(skeys, dests, plain, out)
        self._get_tags(skeys, out, tags)
        zc_ok = sum(1 for i in zc_i if out[i])
        hits = sum(out)
        self._count(get_calls=1, pages_read=hits, read_misses=len(out) - hits, zero_copy_pages_read=zc_ok,
                    bytes_read=hits * pb)
        return out

    def _get_tags(self, skeys: list[str], out: list[bool], tags: list[bytes | None] | None) -> None:
        """Fetch the tag of every page read (``out[i]``) into ``tags[i]``; a page without one (being
        written, evicted apart from it, an older version's) is a miss."""
        hit = [i for i, ok in enumerate(out) if ok]
        if not hit:
            return
        try:
            got = self._store.get_batch([skeys[i] + TAG_SUFFIX for i in hit])
        except Exception as exc:  # noqa: BLE001 - no tag: a miss
            self._error("get_batch", exc)
            got = [None] * len(hit)
        for i, raw in zip(hit, got):
            if raw is None or len(raw) != TAG_BYTES:
                out[i] = False
            elif tags is not None:
                tags[i] = bytes(raw)

    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                   tags: list[bytes | None] | None = None) -> int:
        """Read the leading present pages into ``dests``; returns how many were read whole. One
        ``batch_get_into`` of every key, without the existence RPC that `exists_prefix` + `get_batch`
        pays: a missing key fails on its own in the same call (as cheaply as asking for it), so only
        pages behind a hole are read for nothing."""
        return leading_hits(self.get_batch(keys, dests, tags))

    def _get_into(self, skeys: list[str], addrs: list[int], idx: list[int], out: list[bool]) -> None:
        pb = self.page_bytes
        try:
            res = self._store.batch_get_into(skeys, addrs, [pb] * len(skeys))
        except Exception as exc:  # noqa: BLE001
            self._error("batch_get_into", exc)
            return
        for i, r in zip(idx, res):
            out[i] = r == pb

    def _get_plain(self, skeys: list[str], dests: Sequence[Buffer], plain: list[int], out: list[bool]) -> None:
        """Unregistered destinations: through the registered staging buffer when it is free (one
        transfer + one copy), else Mooncake's ``get_batch`` (bytes objects + one copy)."""
        pb = self.page_bytes
        views = {i: byte_view(dests[i], pb, writable=True) for i in plain}
        staging = self._staging
        if staging.try_acquire():
            try:
                base, cap, sv = staging.addr, staging.pages, staging.view
                for c in range(0, len(plain), cap):
                    chunk = plain[c:c + cap]
                    got = [False] * len(chunk)
                    self._get_into([skeys[i] for i in chunk], [base + j * pb for j in range(len(chunk))],
                                   list(range(len(chunk))), got)
                    for j, i in enumerate(chunk):
                        if got[j]:
                            views[i][:] = sv[j * pb:(j + 1) * pb]
                            out[i] = True
            finally:
                staging.release()
            return
        try:
            datas = self._store.get_batch([skeys[i] for i in plain])
        except Exception as exc:  # noqa: BLE001
            self._error("get_batch", exc)
            return
        for i, data in zip(plain, datas):
            if data is not None and len(data) == pb:
                views[i][:] = data
                out[i] = True

    @gated
    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                  tags: Sequence[bytes] | None = None) -> list[bool]:
        check_batch(keys, srcs, "set_batch")
        tags = check_tags(tags, len(keys))
        out, foreign = self._set_batch(keys, srcs, tags)
        if foreign:  # objects of another page were there, now removed: store this page once more
            again, _ = self._set_batch([keys[i] for i in foreign], [srcs[i] for i in foreign],
                                       [tags[i] for i in foreign])
            for i, ok in zip(foreign, again):
                out[i] = ok
        return out

    def _set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer], tags: list[bytes]) -> tuple[list[bool], list[int]]:
        """One put of the pages and their tags: per page stored, and the indices of pages whose
        key held another page's objects (removed, not stored: `_put_tags`)."""
        zc_all, zc_addr_all, plain_all = self._split(srcs, writable=False)
        addr_of = dict(zip(zc_all, zc_addr_all))
        skeys = self._keys(keys)
        pb = self.page_bytes
        out = [False] * len(keys)
        first: dict[str, int] = {}
        dup: list[tuple[int, int]] = []
        for i, k in enumerate(skeys):
            if k in first:
                dup.append((i, first[k]))
            else:
                first[k] = i
        if dup:
            keep = set(first.values())
            zc_i = [i for i in zc_all if i in keep]
            plain = [i for i in plain_all if i in keep]
        else:
            zc_i, plain = zc_all, plain_all
        if zc_i:
            try:
                res = self._store.batch_put_from([skeys[i] for i in zc_i], [addr_of[i] for i in zc_i],
                                                 [pb] * len(zc_i), self._rconf)
                for i, r in zip(zc_i, res):
                    out[i] = r == 0
            except Exception as exc:  # noqa: BLE001
                self._error("batch_put_from", exc)
        zc_ok = sum(1 for i in zc_i if out[i])
        if plain:
            pkeys = [skeys[i] for i in plain]
            try:
                rc = self._store.put_batch(pkeys, [byte_view(srcs[i], pb, writable=False) for i in plain], self._rconf)
                if rc == 0:
                    for i in plain:
                        out[i] = True
                else:  # which ones made it? (pages are immutable: present means stored)
                    self._error("put_batch", rc)
                    for i, e in zip(plain, self._store.batch_is_exist(pkeys)):
                        out[i] = e == 1
            except Exception as exc:  # noqa: BLE001
                self._error("put_batch", exc)
        foreign = self._put_tags(skeys, tags, [i for i in first.values() if out[i]], out)
        for i, j in dup:
            out[i] = out[j]
        ok = sum(out[i] for i in first.values())
        self._count(set_calls=1, pages_written=ok, write_failures=len(first) - ok - len(foreign),
                    zero_copy_pages_written=zc_ok, bytes_written=ok * pb)
        return out, [i for i, _k in enumerate(skeys) if first[_k] in foreign]

    def _put_tags(self, skeys: list[str], tags: list[bytes], stored: list[int], out: list[bool]) -> list[int]:
        """Store the tag of every page stored (``stored``: indices), then read the tags back: a put
        of an existing object is a silent no-op in Mooncake (the first write wins), so only the
        read-back tells whether the tag there is this one. This tag: the page is stored. None: not
        stored (``out[i] = False``: a reader would miss it). Another tag: the objects there are
        not this page (corrupt, forged, another key's): both are removed and the page counts as
        not stored (returned: `set_batch` stores them again)."""
        if not stored:
            return []
        sum_keys = [skeys[i] + TAG_SUFFIX for i in stored]
        try:
            rc = self._store.put_batch(sum_keys, [tags[i] for i in stored], self._rconf)
            if rc != 0:
                self._error("put_batch", rc)
            found = self._store.get_batch(sum_keys)
        except Exception as exc:  # noqa: BLE001
            self._error("put_batch", exc)
            found = [None] * len(stored)
        foreign = [i for i, raw in zip(stored, found) if raw is not None and bytes(raw) != tags[i]]
        if foreign:
            try:
                self._store.batch_remove([skeys[i] for i in foreign] + [skeys[i] + TAG_SUFFIX for i in foreign], True)
            except Exception as exc:  # noqa: BLE001 - stays a page no read accepts
                self._error("remove", exc)
        for i, raw in zip(stored, found):
            out[i] = out[i] and raw is not None and bytes(raw) == tags[i]
        return foreign

    @gated
    def remove(self, keys: Sequence[bytes]) -> int:
        """Remove pages and their tags (`clear_storage`, and pages the storage tier's check refused);
        returns how many pages went. Forced: our own reads have drained, and a recent one's lease
        would otherwise keep the page; a read of another client racing it finds no tag, or a page
        that fails the check, and is a miss."""
        check_keys(keys)
        skeys = self._keys(list(dict.fromkeys(bytes(k) for k in keys)))
        try:
            codes = self._store.batch_remove(skeys + [k + TAG_SUFFIX for k in skeys], True)
        except Exception as exc:  # noqa: BLE001
            self._error("remove", exc)
            raise StorageError(f"Mooncake batch_remove failed: {exc!r}") from exc
        removed = sum(1 for c in codes[:len(skeys)] if c == 0)
        self._count(removed_pages=removed)
        return removed

    def close(self) -> None:
        """No call starts any more (`StateError`). The store is torn down (buffers unregistered, the
        client closed) by a thread of its own once every call in flight has returned, never under
        one: Mooncake frees the client's memory at close, and a call still inside it (one waiting
        on a dead master's RPC timeout) would run on freed memory. Waits for that at most
        ``config.close_timeout_s``; past it returns, and the calls still inside are abandoned
        (``calls_abandoned_at_close``): the teardown follows when they return, and the process
        waits for it at exit (`CallGate`)."""
        if not self._gate.close(self._teardown, self.config.close_timeout_s) and not self._gate.torn_down:
            _log.warning("mooncake_close_abandoned", calls=self._gate.abandoned, timeout_s=self.config.close_timeout_s)

    def _teardown(self) -> None:
        """Unregister the buffers and close the client: at once when the master answers, else at
        process exit. (Closing a client whose master is gone runs its unmount RPC's retries, ~10 s
        here, inside one call that holds the interpreter lock: every thread, the event loop
        included, would stop that long.)"""
        if not self._master_reachable():
            self._teardown_deferred = True
            _log.warning("mooncake_teardown_deferred", master=self.config.master_server_address)
            _defer_to_exit(self)
            return
        self._teardown_now()

    def reachable(self) -> bool:
        """Whether the master accepts a connection (a dead master: refused at once): the transfer
        actor asks when calls have run a while, so that it need not wait for the client's retries."""
        return self._master_reachable()

    def _master_reachable(self) -> bool:
        host, _, port = self.config.master_server_address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=MASTER_PROBE_S):
                return True
        except (OSError, ValueError):
            return False

    def _teardown_now(self) -> None:
        self._registered.unregister_all()
        self._staging.unregister()
        try:
            self._store.close()
        except Exception as exc:  # noqa: BLE001
            _log.warning("mooncake_close_error", error=str(exc))

    def stats(self) -> dict[str, Any]:
        with self._slock:
            s: dict[str, Any] = dict(self._s)
        s.update(backend="mooncake", page_bytes=self.page_bytes, master=self.config.master_server_address,
                 registered_buffers=len(self._registered), teardown_deferred=self._teardown_deferred,
                 **self._gate.stats())
        return s

    def __enter__(self) -> "MooncakeBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Backends whose teardown waits for process exit (their master was gone when they closed); closed
# by an atexit hook, which runs after the interpreter has joined every worker thread.
_AT_EXIT: list[MooncakeBackend] = []
_AT_EXIT_LOCK = threading.Lock()


def _defer_to_exit(backend: MooncakeBackend) -> None:
    with _AT_EXIT_LOCK:
        if not _AT_EXIT:
            atexit.register(_teardown_at_exit)
        _AT_EXIT.append(backend)


def _teardown_at_exit() -> None:
    with _AT_EXIT_LOCK:
        backends = _AT_EXIT[:]
        _AT_EXIT.clear()
    for backend in backends:
        backend._teardown_now()


def _nbytes(buf: Buffer) -> int:
    if isinstance(buf, torch.Tensor):
        return int(buf.nbytes)
    if hasattr(buf, "nbytes"):
        return int(buf.nbytes)  # numpy, memoryview
    return len(memoryview(buf).cast("B"))
