"""Moving KV bytes between processes: the `KVTransport` contract, Mooncake's Transfer Engine behind it
(`MooncakeTransport`), and an in-process stand-in for tests and fuzzers (`LocalTransport`).

A transport is an endpoint: it registers local CPU buffers, and `write` copies ranges of them into
ranges of a peer's registered buffers, named by the peer's `session`. A write is blocking and all
or nothing for its caller: it returns when every byte has landed, or raises `TransportError` (then
any part of the destination may hold new bytes, and, with Mooncake, the source may still be read:
a transfer that timed out is not cancelled, so the source must stay untouched until the peer is
known gone). Malformed arguments (`ValueError`) and local ranges outside the registered buffers
(`TransportError`) are refused before anything moves.

Mooncake facts this module relies on (Transfer Engine 0.3.13, TCP, P2P handshake, no metadata
server): a session is ``"<host>:<rpc port>"``; ``batch_transfer_sync_write`` returns 0 or -1 and
never raises; a killed peer fails a transfer within ~0.2 s, a frozen one after
``MC_TRANSFER_TIMEOUT`` (at least 5 s, the calling thread spinning); a peer takes ~2048 transfers in
flight before it rejects more, hence batches of at most `MAX_BATCH` and one write per peer at a
time; the engine does not check that a source range is registered (hence our check); its listeners
open on every interface, whatever host is given.
"""

from __future__ import annotations

import bisect
import ctypes
import ipaddress
import itertools
import operator
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from runtime.storage.backend import StorageError
from runtime.storage.mooncake_config import INSTALL_HINT
from runtime.trace import get_logger

_log = get_logger("hicache.disagg")

MAX_BATCH = 1024  # items per engine call: under the engine's per-peer limit of ~2048 in flight
MIN_TIMEOUT_S = 5  # the engine's transfer timeout is never shorter
_ENV_DEFAULTS = {
    "MC_FORCE_TCP": "1",  # never pick RDMA, even where HCAs exist
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # a timed-out batch stays queued: leave room
    "MC_LOG_LEVEL": "WARNING",
}


class TransportError(StorageError):
    """A transfer failed (peer gone, frozen or refusing, endpoint closed, injected fault), or its
    local ranges are not registered. Nothing is known about which destination bytes landed."""


Item = tuple[int, int, int]  # (source address, destination address, length)


@runtime_checkable
class KVTransport(Protocol):
    """An endpoint that writes local registered memory into a peer's registered memory."""

    session: str  # how a peer names this endpoint (the `peer` argument of its `write`)

    def register(self, buffer: torch.Tensor) -> None:
        """Makes a contiguous CPU tensor a source and destination of transfers (the same memory
        again: no-op; memory overlapping a registered buffer otherwise: `ValueError`)."""
        ...

    def unregister(self, buffer: torch.Tensor) -> None:
        """The reverse of `register` (a buffer not registered: no-op)."""
        ...

    def write(self, peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        """Copies ``lengths[i]`` bytes from local ``src_addrs[i]`` to the peer's ``dst_addrs[i]``,
        for every i; blocks until all landed; raises `TransportError` on any failure."""
        ...

    def close(self) -> None:
        """Unregisters everything and stops the endpoint; writes after it fail (idempotent)."""
        ...


def _index(value: Any, what: str) -> int:
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None
    if isinstance(value, bool) or out < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return out


def validated(peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> list[Item]:
    """The write's items as plain ints; `ValueError` for a bad peer, unequal lists, an address
    that is not a non-negative int, or a length that is not a positive int."""
    if not isinstance(peer, str) or not peer:
        raise ValueError(f"peer must be a non-empty session string, got {peer!r}")
    if not len(src_addrs) == len(dst_addrs) == len(lengths):
        raise ValueError(f"src_addrs, dst_addrs and lengths differ in length: "
                         f"{len(src_addrs)}, {len(dst_addrs)}, {len(lengths)}")
    items = []
    for i, (s, d, n) in enumerate(zip(src_addrs, dst_addrs, lengths, strict=True)):
        n = _index(n, f"lengths[{i}]")
        if n == 0:
            raise ValueError(f"lengths[{i}] must be positive, got 0")
        items.append((_index(s, f"src_addrs[{i}]"), _index(d, f"dst_addrs[{i}]"), n))
    return items


class RegisteredBuffers:
    """The CPU tensors an endpoint registered, by address range (held: none is freed while
    registered). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted; ranges never overlap
        self._ends: list[int] = []
        self._tensors: dict[int, torch.Tensor] = {}  # by start

    @staticmethod
    def span(buffer: torch.Tensor) -> tuple[int, int]:
        """(address, bytes) of a buffer fit to register; `ValueError` otherwise."""
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(f"a buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"a buffer must be a contiguous CPU tensor, got device={buffer.device} "
                             f"contiguous={buffer.is_contiguous()}")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            raise ValueError("a buffer must hold at least one byte")
        return buffer.data_ptr(), nbytes

    def is_new(self, buffer: torch.Tensor) -> bool:
        """False when this buffer is registered already; `ValueError` when it overlaps another."""
        ptr, nbytes = self.span(buffer)
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0 and self._starts[i] == ptr and self._ends[i] == ptr + nbytes:
                return False
            if (i >= 0 and self._ends[i] > ptr) or (i + 1 < len(self._starts) and self._starts[i + 1] < ptr + nbytes):
                raise ValueError(f"buffer [{ptr:#x}, +{nbytes}) overlaps a registered buffer")
        return True

    def add(self, buffer: torch.Tensor) -> None:
        ptr, nbytes = self.span(buffer)
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + nbytes)
            self._tensors[ptr] = buffer

    def remove(self, buffer: torch.Tensor) -> bool:
        """False when the buffer was not registered (as this span)."""
        ptr, nbytes = self.span(buffer)
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i == len(self._starts) or self._starts[i] != ptr or self._ends[i] != ptr + nbytes:
                return False
            del self._starts[i], self._ends[i], self._tensors[ptr]
        return True

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside one registered buffer."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            return i >= 0 and addr + nbytes <= self._ends[i]

    def outside(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int, int] | None:
        """The first (index, address, bytes) of `ranges` not inside a registered buffer, if any."""
        for i, (addr, nbytes) in enumerate(ranges):
            if not self.contains(addr, nbytes):
                return i, addr, nbytes
        return None

    def tensors(self) -> list[torch.Tensor]:
        with self._lock:
            return list(self._tensors.values())


def require_local(buffers: RegisteredBuffers, items: Sequence[Item], session: str) -> None:
    """`TransportError` unless every source range lies inside a registered buffer."""
    bad = buffers.outside([(s, n) for s, _d, n in items])
    if bad is not None:
        i, addr, nbytes = bad
        raise TransportError(f"{session}: source {i} [{addr:#x}, +{nbytes}) is not inside a registered buffer")


# -- Mooncake Transfer Engine --------------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine  # noqa: PLC0415
    except ImportError as exc:
        raise StorageError(f"Mooncake's Transfer Engine (mooncake.engine) is not installed ({exc}); "
                           f"{INSTALL_HINT}") from exc
    return TransferEngine


def _set_env(host: str, timeout_s: int) -> None:
    """The engine's settings, each only where the environment has none (read at initialize)."""
    wanted = {**_ENV_DEFAULTS, "MC_TRANSFER_TIMEOUT": str(timeout_s), "MC_TCP_BIND_ADDRESS": host}
    for name, value in wanted.items():
        have = os.environ.setdefault(name, value)
        if have != value:
            _log.info("transport_env_kept", name=name, value=have, ours=value)


class MooncakeTransport:
    """Mooncake's Transfer Engine over TCP in P2P handshake mode (no metadata server): a peer is
    reached by its `session` alone. Thread-safe: writes to one peer run one at a time (the
    engine's per-peer limit), writes to different peers at once. The ``MC_*`` settings are the
    process's: the first endpoint's (or the environment's) hold for every later one."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: int = 5, *, allow_non_loopback: bool = False) -> None:
        """``host``: the address peers reach this endpoint at; anything but loopback only with
        ``allow_non_loopback`` (the engine listens on every interface, and the bytes go in the
        clear). ``timeout_s``: how long a transfer to a frozen peer may block (at least 5)."""
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty string, got {host!r}")
        if not _is_loopback(host) and not allow_non_loopback:
            raise ValueError(f"host {host!r} is not loopback: pass allow_non_loopback=True to serve on it")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < MIN_TIMEOUT_S:
            raise ValueError(f"timeout_s must be an int >= {MIN_TIMEOUT_S} (the engine's floor), got {timeout_s!r}")
        _set_env(host, timeout_s)
        engine = _engine_class()()
        rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransportError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) failed: rc={rc}")
        self._engine: Any = engine
        self.session = f"{host}:{engine.get_rpc_port()}"
        self.timeout_s = timeout_s
        self._buffers = RegisteredBuffers()
        self._lock = threading.Lock()  # registration, the peer locks, the call count, closing
        self._idle = threading.Condition(self._lock)  # notified when the last write ends
        self._peer_locks: dict[str, threading.Lock] = {}
        self._writes = 0  # writes in progress
        self._closed = False
        _log.info("transport_open", kind="mooncake", session=self.session, timeout_s=timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def register(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._check_open()
            if not self._buffers.is_new(buffer):
                return
            ptr, nbytes = RegisteredBuffers.span(buffer)
            rc = self._engine.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransportError(f"{self.session}: register_memory({ptr:#x}, {nbytes}) failed: rc={rc}")
            self._buffers.add(buffer)
        _log.debug("transport_registered", session=self.session, addr=ptr, nbytes=nbytes)

    def unregister(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._closed or not self._buffers.remove(buffer):
                return
            rc = self._engine.unregister_memory(buffer.data_ptr())
        if rc != 0:
            _log.warning("transport_unregister_failed", session=self.session, addr=buffer.data_ptr(), rc=rc)
            raise TransportError(f"{self.session}: unregister_memory({buffer.data_ptr():#x}) failed: rc={rc}")

    def write(self, peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        items = validated(peer, src_addrs, dst_addrs, lengths)
        with self._lock:
            self._check_open()
            require_local(self._buffers, items, self.session)
            if not items:
                return
            self._writes += 1
            peer_lock = self._peer_locks.setdefault(peer, threading.Lock())
        try:
            with peer_lock:
                self._write_batches(peer, items)
        finally:
            with self._lock:
                self._writes -= 1
                if self._writes == 0:
                    self._idle.notify_all()

    def _write_batches(self, peer: str, items: list[Item]) -> None:
        for start in range(0, len(items), MAX_BATCH):
            chunk = items[start:start + MAX_BATCH]
            t0 = time.monotonic()
            rc = self._engine.batch_transfer_sync_write(peer, [s for s, _d, _n in chunk], [d for _s, d, _n in chunk],
                                                        [n for _s, _d, n in chunk])
            if rc != 0:
                _log.warning("transport_write_failed", session=self.session, peer=peer, rc=rc, items=len(items),
                             failed_at=start, seconds=round(time.monotonic() - t0, 3))
                landed = f"items 0..{start - 1} landed; " if start else ""
                raise TransportError(f"{self.session} -> {peer}: batch_transfer_sync_write failed: rc={rc} "
                                     f"(items {start}..{start + len(chunk) - 1} of {len(items)}: {landed}"
                                     f"these may still land, their sources may still be read)")

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.session}: the transport is closed")

    def close(self) -> None:
        """Waits for the writes in progress, unregisters every buffer and drops the engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._writes:
                self._idle.wait()
            engine, self._engine = self._engine, None
            tensors = self._buffers.tensors()
            for t in tensors:
                self._buffers.remove(t)
        failed = [t.data_ptr() for t in tensors if engine.unregister_memory(t.data_ptr()) != 0]
        del engine  # the engine's threads and listeners end here (~0.5 s)
        if failed:
            _log.warning("transport_unregister_failed", session=self.session, addrs=failed)
        _log.info("transport_closed", kind="mooncake", session=self.session)


# -- in-process stand-in ---------------------------------------------------------------------------
_LOCAL_ENDPOINTS: dict[str, LocalTransport] = {}
_LOCAL_LOCK = threading.Lock()
_LOCAL_IDS = itertools.count()


class LocalTransport:
    """An in-process endpoint: peers are found by session in a module-level registry and bytes
    copied with ``memmove``. Both sides' ranges are checked against their registered buffers.

    Fault hooks, set by tests: `fail_next` (the next N writes from this endpoint raise
    `TransportError`, nothing moved), `delay_s` (each write sleeps this long before copying; a peer
    closed meanwhile fails it), `closed` (a killed endpoint: writes from or to it fail)."""

    def __init__(self, session: str | None = None) -> None:
        with _LOCAL_LOCK:
            name = session if session is not None else f"local:{next(_LOCAL_IDS)}"
            if not isinstance(name, str) or not name or name in _LOCAL_ENDPOINTS:
                raise ValueError(f"session must be a new non-empty string, got {name!r}")
            _LOCAL_ENDPOINTS[name] = self
        self.session = name
        self.fail_next = 0
        self.delay_s = 0.0
        self.closed = False
        self.writes = 0  # writes that moved their bytes
        self._buffers = RegisteredBuffers()
        self._lock = threading.Lock()  # fail_next, writes

    def register(self, buffer: torch.Tensor) -> None:
        if self._buffers.is_new(buffer):
            self._buffers.add(buffer)

    def unregister(self, buffer: torch.Tensor) -> None:
        self._buffers.remove(buffer)

    def accepts(self, ranges: Sequence[tuple[int, int]]) -> tuple[int, int, int] | None:
        """The first (index, address, bytes) of `ranges` outside this endpoint's registered buffers."""
        return self._buffers.outside(ranges)

    def write(self, peer: str, src_addrs: Sequence[int], dst_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        items = validated(peer, src_addrs, dst_addrs, lengths)
        if self.closed:
            raise TransportError(f"{self.session}: the transport is closed")
        require_local(self._buffers, items, self.session)
        with self._lock:
            injected = self.fail_next > 0
            if injected:
                self.fail_next -= 1
        if injected:
            raise TransportError(f"{self.session} -> {peer}: injected failure")
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        target = _LOCAL_ENDPOINTS.get(peer)
        if target is None or target.closed:
            raise TransportError(f"{self.session} -> {peer}: no such peer (closed or never opened)")
        bad = target.accepts([(d, n) for _s, d, n in items])
        if bad is not None:
            i, addr, nbytes = bad
            raise TransportError(f"{self.session} -> {peer}: destination {i} [{addr:#x}, +{nbytes}) is not "
                                 f"inside a buffer the peer registered")
        for s, d, n in items:
            ctypes.memmove(d, s, n)
        with self._lock:
            self.writes += 1

    def close(self) -> None:
        self.closed = True
        with _LOCAL_LOCK:
            if _LOCAL_ENDPOINTS.get(self.session) is self:
                del _LOCAL_ENDPOINTS[self.session]
        for t in self._buffers.tensors():
            self._buffers.remove(t)
