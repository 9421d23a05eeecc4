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

`LocalMooncakeCluster` starts a master and a metadata server on 127.0.0.1 (tests, benchmarks,
a single-machine deployment). See docs/STORAGE.md for pointing the backend at a real cluster.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
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
from runtime.trace import get_logger

_log = get_logger("hicache.storage.mooncake")

_PR_SET_PDEATHSIG = 1
# looked up here, not in the forked child (a dlopen there could wait on a lock another thread held)
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
MASTER_PROBE_S = 0.5  # a master that accepts no connection within this long is gone (teardown at exit)
TAG_SUFFIX = "/tag"  # companion object of a page: its tag (the storage tier's, TAG_BYTES)
INSTALL_HINT = "install it with scripts/install_mooncake.sh (Debian libibverbs1 libnl-3-200 libnl-route-3-200 + " \
               "pip mooncake-transfer-engine-non-cuda)"
_SIZE_SUFFIXES = (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("t", 1 << 40),
                  ("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10), ("b", 1))


def parse_size(value: int | str) -> int:
    """``123``, ``"123"``, ``"512mb"``, ``"4GB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    s = str(value).strip().lower().replace(" ", "")
    for suffix, mult in _SIZE_SUFFIXES:
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach a Mooncake Store cluster (field names follow Mooncake's own config)."""

    master_server_address: str                 # "host:port" of mooncake_master's RPC
    metadata_server: str                       # "http://host:port/metadata", "etcd://host:2379", "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"          # the address peers use to reach this client
    global_segment_size: int = 512 << 20       # memory this process contributes to the pool (0: none)
    local_buffer_size: int = 128 << 20         # this client's transfer buffer for the plain calls
    protocol: str = "tcp"                      # "tcp" or "rdma"
    device_name: str = ""                      # RDMA NICs, e.g. "mlx5_0,mlx5_1" (or "" / "auto-discovery")
    replica_num: int = 1
    key_prefix: str = "hicache/"
    tcp_bind_address: str | None = None        # exported as MC_TCP_BIND_ADDRESS before setup
    env: dict[str, str] = field(default_factory=dict)  # other MC_* variables to export before setup
    close_timeout_s: float = 5.0               # how long close() waits for calls in flight (then abandons them)

    def __post_init__(self) -> None:
        for name in ("global_segment_size", "local_buffer_size"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
            if getattr(self, name) < 0:
                raise ConfigError(f"MooncakeConfig.{name} must be >= 0")
        if not self.master_server_address or ":" not in self.master_server_address:
            raise ConfigError(f"master_server_address must be 'host:port', got {self.master_server_address!r}")
        if not self.metadata_server:
            raise ConfigError("metadata_server must be set (http://host:port/metadata, etcd://..., P2PHANDSHAKE)")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not isinstance(self.replica_num, int) or self.replica_num < 1:
            raise ConfigError(f"replica_num must be >= 1, got {self.replica_num!r}")
        if isinstance(self.close_timeout_s, bool) or not isinstance(self.close_timeout_s, (int, float)) \
                or not 0 <= self.close_timeout_s < float("inf"):
            raise ConfigError(f"close_timeout_s must be a finite number >= 0, got {self.close_timeout_s!r}")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "MooncakeConfig":
        known = {f.name for f in fields(MooncakeConfig)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown MooncakeConfig keys {sorted(unknown)}")
        return MooncakeConfig(**d)

    @staticmethod
    def from_file(path: str) -> "MooncakeConfig":
        with open(path, encoding="utf-8") as f:
            return MooncakeConfig.from_dict(json.load(f))

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> "MooncakeConfig":
        """``MOONCAKE_CONFIG_PATH`` (a JSON file of these fields), else the variables Mooncake and
        SGLang use: ``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_LOCAL_HOSTNAME``,
        ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL``,
        ``MOONCAKE_DEVICE``, ``MOONCAKE_TCP_BIND_ADDRESS``, ``MOONCAKE_KEY_PREFIX``."""
        env = os.environ if environ is None else environ
        path = env.get("MOONCAKE_CONFIG_PATH")
        if path:
            return MooncakeConfig.from_file(path)
        if not env.get("MOONCAKE_MASTER"):
            raise ConfigError("set MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER to use the Mooncake backend")
        d: dict[str, Any] = {
            "master_server_address": env["MOONCAKE_MASTER"],
            "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
        }
        for var, name in (("MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
                          ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
                          ("MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size"),
                          ("MOONCAKE_PROTOCOL", "protocol"), ("MOONCAKE_DEVICE", "device_name"),
                          ("MOONCAKE_TCP_BIND_ADDRESS", "tcp_bind_address"), ("MOONCAKE_KEY_PREFIX", "key_prefix")):
            if env.get(var):
                d[name] = env[var]
        return MooncakeConfig(**d)


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
        self._reg_lock = threading.Lock()
        self._reg_starts: list[int] = []
        self._reg_ends: list[int] = []
        self._reg_objs: list[Any] = []
        self._gate = CallGate("MooncakeBackend")
        self._teardown_deferred = False  # the master was gone at close: torn down at process exit
        self._staging: np.ndarray | None = None
        self._staging_lock = threading.Lock()
        self._staging_pages = max(1, staging_bytes // page_bytes) if staging_bytes > 0 else 0
        if self._staging_pages:
            staging = np.ones(self._staging_pages * page_bytes, dtype=np.uint8)  # touched: no faults later
            if self._store.register_buffer(int(staging.ctypes.data), staging.nbytes) == 0:
                self._staging = staging
                self._staging_addr = int(staging.ctypes.data)
                self._staging_view = memoryview(staging)
            else:
                _log.warning("mooncake_staging_register_failed", bytes=staging.nbytes)
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
        with self._reg_lock:
            i = bisect.bisect_right(self._reg_starts, addr)
            if (i > 0 and self._reg_ends[i - 1] > addr) or (i < len(self._reg_starts) and self._reg_starts[i] < addr + n):
                raise ConfigError("buffer overlaps a registered buffer")
            rc = self._store.register_buffer(addr, n)
            if rc != 0:
                raise StorageError(f"Mooncake register_buffer failed ({rc})")
            self._reg_starts.insert(i, addr)
            self._reg_ends.insert(i, addr + n)
            self._reg_objs.insert(i, buf)

    @gated
    def unregister_buffer(self, buf: Buffer) -> None:
        addr = buffer_address(buf)
        with self._reg_lock:
            i = bisect.bisect_left(self._reg_starts, addr)
            if i == len(self._reg_starts) or self._reg_starts[i] != addr:
                raise ConfigError("buffer is not registered")
            self._store.unregister_buffer(addr)
            del self._reg_starts[i], self._reg_ends[i], self._reg_objs[i]

    def _split(self, bufs: Sequence[Buffer], writable: bool) -> tuple[list[int], list[int], list[int]]:
        """Indices and addresses of the buffers inside registered memory (zero-copy), and the
        indices of the others. Validates every buffer (size, contiguity, CPU, writability)."""
        pb = self.page_bytes
        with self._reg_lock:
            starts, ends = list(self._reg_starts), list(self._reg_ends)
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
        except Exception as exc:  # noqa: BLE001 - a transport error is a miss
            self._error("batch_is_exist", exc)
            return 0
        n = 0
        for r in res:
            if r != 1:
                if r < 0:
                    self._error("batch_is_exist", r)
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
        if self._staging is not None and self._staging_lock.acquire(blocking=False):
            try:
                base, cap = self._staging_addr, self._staging_pages
                sv = self._staging_view
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
                self._staging_lock.release()
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

    def _master_reachable(self) -> bool:
        host, _, port = self.config.master_server_address.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=MASTER_PROBE_S):
                return True
        except (OSError, ValueError):
            return False

    def _teardown_now(self) -> None:
        with self._reg_lock:
            for addr in self._reg_starts:
                try:
                    self._store.unregister_buffer(addr)
                except Exception:  # noqa: BLE001
                    pass
            self._reg_starts.clear(); self._reg_ends.clear(); self._reg_objs.clear()
        with self._staging_lock:
            if self._staging is not None:
                try:
                    self._store.unregister_buffer(self._staging_addr)
                except Exception:  # noqa: BLE001
                    pass
                self._staging = None
        try:
            self._store.close()
        except Exception as exc:  # noqa: BLE001
            _log.warning("mooncake_close_error", error=str(exc))

    def stats(self) -> dict[str, Any]:
        with self._slock:
            s: dict[str, Any] = dict(self._s)
        s.update(backend="mooncake", page_bytes=self.page_bytes, master=self.config.master_server_address,
                 registered_buffers=len(self._reg_starts), teardown_deferred=self._teardown_deferred,
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


# -- a local cluster (tests, benchmarks, one-machine deployments) ------------------------------

def find_binary(name: str) -> str | None:
    """A Mooncake executable: next to this Python (the venv's bin), else on PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which(name, path=here + os.pathsep + os.environ.get("PATH", ""))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int) -> None:
    """In a spawned server, before it runs: SIGKILL it when the process that started it dies, even
    by a crash that runs no `stop()` (Linux ``PR_SET_PDEATHSIG``; strictly, when the *thread* that
    started it ends: start a cluster from a thread that outlives it, e.g. the main thread)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody would stop us
        os._exit(1)


def _wait_port(host: str, port: int, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.02)
    return False


class LocalMooncakeCluster:
    """A ``mooncake_master`` and a standalone ``mooncake_http_metadata_server``, both listening on
    127.0.0.1 only (free ports), started and stopped (and reaped) by this object; both are killed
    when the process that started them dies, so even a crash that runs no `stop()` leaves none
    behind (Linux; `_die_with_parent`).

    The master's built-in metadata server is not used: it ignores its host flag. Note that
    Mooncake *clients* (`MooncakeBackend`) open their transfer listeners on all interfaces
    whatever ``MC_TCP_BIND_ADDRESS`` says; the tests therefore run in a private network
    namespace (see tests/unit/storage/conftest.py)."""

    HOST = "127.0.0.1"

    def __init__(self, *, lease_ttl_ms: int = 500, eviction_high_watermark: float = 0.9,
                 log_dir: str | None = None, start_timeout_s: float = 20.0) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="mooncake-")
        self.start_timeout_s = start_timeout_s
        self.rpc_port = self.metadata_port = self.metrics_port = 0
        self._procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    @property
    def master_address(self) -> str:
        return f"{self.HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.HOST}:{self.metadata_port}/metadata"

    @property
    def pids(self) -> dict[str, int]:
        """The running cluster's processes: ``{"metadata": pid, "master": pid}``."""
        return {name: p.pid for name, p in zip(("metadata", "master"), self._procs)}

    @property
    def master_pid(self) -> int:
        return self.pids["master"]

    def config(self, **overrides: Any) -> MooncakeConfig:
        base = MooncakeConfig(master_server_address=self.master_address, metadata_server=self.metadata_url,
                              local_hostname=self.HOST, tcp_bind_address=self.HOST)
        return replace(base, **overrides) if overrides else base

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        self._logs.append(log)
        env = dict(os.environ)
        env.setdefault("MC_TCP_BIND_ADDRESS", self.HOST)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        self._procs.append(p)
        return p

    def log_tail(self, name: str, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> "LocalMooncakeCluster":
        master = find_binary("mooncake_master")
        meta = find_binary("mooncake_http_metadata_server")
        if not master or not meta:
            raise StorageError(f"mooncake_master / mooncake_http_metadata_server not found; {INSTALL_HINT}")
        last = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.stop()
            self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
            deadline = time.monotonic() + self.start_timeout_s
            pm = self._spawn([meta, "--host", self.HOST, "--port", str(self.metadata_port), "--log-level", "WARNING"],
                             "metadata")
            pr = self._spawn([master, f"--rpc_address={self.HOST}", f"--rpc_port={self.rpc_port}",
                              "--enable_http_metadata_server=false", f"--metrics_host={self.HOST}",
                              f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                              f"--eviction_high_watermark_ratio={self.eviction_high_watermark}"], "master")
            if _wait_port(self.HOST, self.metadata_port, pm, deadline) and _wait_port(self.HOST, self.rpc_port, pr, deadline):
                return self
            last = f"master log: {self.log_tail('master')}\nmetadata log: {self.log_tail('metadata')}"
        self.stop()
        raise StorageError(f"local Mooncake cluster did not start\n{last}")

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> "LocalMooncakeCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
