"""The storage backend protocol, shared buffer helpers and a fault-injecting wrapper.

A backend stores *pages*: the canonical bytes of one page of KV (``[L, C, page_size, H, D]``
in the KV dtype, C = 2 for K and V or 1 for an MLA latent, independent of the host layout), addressed by a page hash (``bytes``,
see `runtime.storage.hashing`). Every page of one backend instance has the same size,
``page_bytes``, fixed at construction and checked on every call. Each page is stored with its
*tag* (``TAG_BYTES``, opaque to the backend), which reads hand back: the storage tier computes
it as the page leaves the host pool and checks it once the bytes landed in the host pool
(`write_pages`, `read_prefix`, `read_pages`; `runtime.storage.integrity`).

Calls are synchronous and thread-safe: the runtime runs them in worker threads, off the
event loop, one batch per call. Presence is only a hint: another process, the backend's
own eviction or an operator may remove a page at any time, so ``exists_prefix`` followed
by ``get_batch`` can still miss (``False`` for that page). A page whose write did not
complete is never readable. I/O failures are reported per page (``False``) and counted in
``stats()``; exceptions are for misuse (`ValidationError`: wrong sizes, bad keys;
`StateError`: closed backend) and for `StorageError` from fault injection or a backend
whose transport failed as a whole. The caller treats any exception as a miss for the batch.
"""

from __future__ import annotations

import ctypes
import functools
import random
import reprlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, Union, runtime_checkable

import numpy as np
import torch

from runtime.errors import HiCacheError, StateError, ValidationError
from runtime.storage.integrity import TAG_BYTES, PageSeal
from runtime.trace import get_logger

_log = get_logger("hicache.storage")
Buffer = Union[memoryview, bytearray, bytes, np.ndarray, torch.Tensor]
MAX_KEY_BYTES = 64


class StorageError(HiCacheError):
    """A storage call failed as a whole (transport down, injected fault). The caller counts a miss."""


class ContractViolation(StorageError):
    """A backend call returned a value outside its contract: a count that is not an int in
    ``[0, len(keys)]``, or per-page flags that are not exactly ``len(keys)`` bools. The runtime
    trusts no such value (a count of -1 would adopt host pages nothing was read into): the whole
    op is a miss."""

    def __init__(self, call: str, value: object, expected: str) -> None:
        self.call = call
        self.value = reprlib.repr(value)
        super().__init__(f"{call} returned {self.value}, expected {expected}")


@runtime_checkable
class StorageBackend(Protocol):
    """What the transfer actor needs from a storage tier (all methods synchronous, thread-safe)."""

    page_bytes: int

    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys exist (stops at the first missing one). A hint, not a promise."""
        ...

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        """Read page ``keys[i]`` into ``dests[i]`` (a writable, contiguous, ``page_bytes``-sized CPU
        buffer). ``True`` per page that was read whole; a ``False`` page's buffer content is undefined.
        ``tags`` (a list of ``len(keys)``): set ``tags[i]`` to the tag stored with each page read."""
        ...

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                  tags: Sequence[bytes] | None = None) -> list[bool]:
        """Store ``srcs[i]`` under ``keys[i]`` with tag ``tags[i]`` (None: an empty tag, which no
        check accepts). ``True`` once the page is complete and readable (a page already present
        counts as stored: pages are immutable, same key same bytes)."""
        ...

    def close(self) -> None:
        """No call starts any more (later calls raise `StateError`); resources are released once
        the calls in flight have left, and close waits for that at most a bounded time
        (`CallGate`). Idempotent."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (see docs/STORAGE.md for the schema)."""
        ...


# -- optional capabilities ----------------------------------------------------------------------
# A backend may also offer (looked up on the instance; wrappers that forward unknown attributes,
# like `FaultyBackend`, set them to None / False so that their own hooks are not bypassed):
#
# - ``get_prefix(keys, dests, tags=None) -> int``: read the leading pages that are present into ``dests`` and
#   return how many were read whole, stopping at the first page that is missing or unreadable
#   (``dests`` past that point: content undefined). One pass instead of `exists_prefix` + `get_batch`
#   (the file backend skips its stat pass, Mooncake its existence RPC); ``tags`` as for `get_batch`.
#   `read_prefix` uses it.
# - ``read_chunk_bytes = n``: calls are local and cheap (no round trip): `read_prefix` splits a read
#   into calls of at most ``n`` bytes (at least one page) and checks each chunk's tags as its call
#   returns, while its pages are still in the CPU cache.
# - ``exists_is_local = True``: `exists_prefix` of a key or two is a local metadata lookup
#   (microseconds, no network), cheap enough to run on the event loop; the transfer actor then
#   answers a read whose first page is absent without a worker thread.
# - ``reachable() -> bool``: is it there at all (Mooncake: its master accepts a connection)? Asked
#   when calls run long; False: down at once (`actors/backend_gate.py`).
# - ``read_only = True``: it stores nothing (a prefill peer): the storage tier issues no write to it.
# - ``evicts_tails_first = True``: it evicts a chain's later pages before its earlier ones (its LRU
#   stamps earlier pages newer): a lookup may ask from the last page known stored (`TiersOnlyCore`).


# -- results checked against the contract -------------------------------------------------------
# Every value a backend hands the runtime goes through one of these two (the transfer actor's
# lookups and writes, and `read_prefix`); anything else raises `ContractViolation`.

def can_remove(storage: Any) -> bool:
    """The backend offers `remove(keys) -> int` (what `clear_storage` needs)."""
    return storage is not None and callable(getattr(storage, "remove", None))


def checked_count(call: str, value: object, nkeys: int) -> int:
    """``value`` as a page count of a call over ``nkeys`` keys: a Python or numpy integer (not a
    bool) in ``[0, nkeys]``."""
    if isinstance(value, (int, np.integer)) and type(value) is not bool and 0 <= value <= nkeys:
        return int(value)
    raise ContractViolation(call, value, f"an int in [0, {nkeys}]")


def checked_flags(call: str, value: object, nkeys: int) -> tuple[bool, ...]:
    """``value`` as per-page results of a call over ``nkeys`` keys: a list, tuple or 1-D numpy bool
    array of exactly ``nkeys`` bools."""
    if isinstance(value, np.ndarray):
        if value.dtype == np.bool_ and value.ndim == 1 and len(value) == nkeys:
            return tuple(bool(x) for x in value)
    elif isinstance(value, (list, tuple)) and len(value) == nkeys \
            and all(type(x) is bool or isinstance(x, np.bool_) for x in value):
        return tuple(bool(x) for x in value)
    raise ContractViolation(call, value, f"{nkeys} bools")


def write_pages(backend: Any, keys: Sequence[bytes], srcs: Sequence[Buffer], seal: PageSeal) -> tuple[bool, ...]:
    """`set_batch` of ``srcs`` (host pool pages) with the tags ``seal`` computes from them, checked."""
    return checked_flags("set_batch", backend.set_batch(list(keys), srcs, seal.tags(keys, srcs)), len(keys))


def read_prefix(backend: Any, keys: Sequence[bytes], dests: Sequence[Buffer], seal: PageSeal) -> int:
    """How many leading pages of ``keys`` were read whole into ``dests`` and verified there:
    ``backend.get_prefix`` when the backend has one, else `exists_prefix` then `get_batch` of the
    leading existing pages (a page found missing or unreadable ends the prefix: presence is only a
    hint); then each page's tag is checked against the bytes in its destination, after the call
    returned, and the first that fails ends the prefix too (`verified`). Every result is checked
    (`ContractViolation`), so the count returned is always in ``[0, len(keys)]``."""
    get_prefix = getattr(backend, "get_prefix", None)
    if get_prefix is None:
        n = checked_count("exists_prefix", backend.exists_prefix(keys), len(keys))
        if n == 0:
            return 0
        tags: list[bytes | None] = [None] * n
        n = leading_hits(checked_flags("get_batch", backend.get_batch(keys[:n], dests[:n], tags), n))
        return leading_hits(verified(backend, seal, keys[:n], dests[:n], tags[:n], prefix=True))
    # a local backend's calls cost little: read a chunk at a time and check it while its pages are
    # still in the CPU cache (one more pass over a whole batch's bytes from memory ran at ~0.6x of
    # the unchecked read here; chunk by chunk, 0.7-0.9x), each chunk after its call returned
    chunk = getattr(backend, "read_chunk_bytes", 0)
    step = max(1, chunk // backend.page_bytes) if chunk else max(1, len(keys))
    done = 0
    while done < len(keys):
        part = slice(done, done + step)
        want = len(keys[part])
        tags = [None] * want
        n = checked_count("get_prefix", get_prefix(keys[part], dests[part], tags), want)
        got = leading_hits(verified(backend, seal, keys[part][:n], dests[part][:n], tags[:n], prefix=True))
        done += got
        if got < want:
            break
    return done


def read_pages(backend: Any, keys: Sequence[bytes], dests: Sequence[Buffer], seal: PageSeal) -> tuple[bool, ...]:
    """`get_batch` of ``keys`` into ``dests``, each page read checked against its tag in its
    destination: per page, read whole and verified."""
    tags: list[bytes | None] = [None] * len(keys)
    got = checked_flags("get_batch", backend.get_batch(list(keys), dests, tags), len(keys))
    return tuple(verified(backend, seal, keys, [d if ok else None for d, ok in zip(dests, got)], tags))


def verified(backend: Any, seal: PageSeal, keys: Sequence[bytes], dests: Sequence[Buffer | None],
             tags: Sequence[object], *, prefix: bool = False) -> list[bool]:
    """Per page read (a ``None`` destination: not read), whether its tag checks out against its
    bytes in its destination; ``prefix``: stop at the first page that does not (a read of leading
    pages). A page that fails is a miss, counted by ``seal``, logged, and removed from the backend
    when it can remove pages (so that a later write stores it again: a present page is never
    rewritten), best effort."""
    out = [False] * len(keys)
    bad: list[bytes] = []
    for i, key in enumerate(keys):
        if dests[i] is None:
            continue
        if seal.check(key, dests[i], tags[i]):
            out[i] = True
            continue
        bad.append(bytes(key))
        _log.warning("storage_page_rejected", key=bytes(key).hex(),
                     reason="no tag" if tags[i] is None else "tag mismatch", keyed=seal.keyed)
        if prefix:
            break
    if bad and can_remove(backend):
        try:
            backend.remove(bad)
        except Exception as exc:  # noqa: BLE001 - the page stays a miss either way
            _log.warning("storage_rejected_remove_failed", pages=len(bad), error=repr(exc))
    return out


def leading_hits(got: Sequence[bool]) -> int:
    """How many of a batch read's results, from the first, are hits (a prefix ends at a miss)."""
    k = 0
    while k < len(got) and got[k]:
        k += 1
    return k


# -- buffer helpers ---------------------------------------------------------------------------

def byte_view(buf: Buffer, nbytes: int, *, writable: bool) -> memoryview:
    """A flat ``'B'`` memoryview over ``buf`` that must be exactly ``nbytes`` long, contiguous and on
    the CPU (writable when asked). No copy is made."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValidationError(f"storage buffers must be CPU tensors, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValidationError("storage buffers must be contiguous tensors")
        if buf.nbytes != nbytes:
            raise ValidationError(f"storage buffer holds {buf.nbytes} bytes, the page size is {nbytes}")
        # a view of the tensor's memory without torch ops (any dtype, bf16 included); valid while
        # the caller keeps `buf` alive, which it does for the duration of the call
        return memoryview((ctypes.c_ubyte * nbytes).from_address(buf.data_ptr())).cast("B")
    elif isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValidationError("storage buffers must be C-contiguous arrays")
        mv = memoryview(buf.reshape(-1).view(np.uint8))
    else:
        mv = memoryview(buf)
        if not mv.contiguous:
            raise ValidationError("storage buffers must be contiguous")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
    if mv.nbytes != nbytes:
        raise ValidationError(f"storage buffer holds {mv.nbytes} bytes, the page size is {nbytes}")
    if writable and mv.readonly:
        raise ValidationError("storage read destination is read-only")
    return mv


def buffer_address(buf: Buffer) -> int:
    """Address of the first byte of a contiguous CPU buffer (for zero-copy transports)."""
    if isinstance(buf, torch.Tensor):
        return int(buf.data_ptr())
    if isinstance(buf, np.ndarray):
        return int(buf.ctypes.data)
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return 0
    return int(np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8).ctypes.data)


def check_keys(keys: Sequence[bytes]) -> None:
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValidationError(f"storage keys must be 1..{MAX_KEY_BYTES} bytes, got {k!r:.40}")


def check_tags(tags: Sequence[bytes] | None, nkeys: int) -> list[bytes]:
    """A write's tags, one of ``TAG_BYTES`` per key (None: empty tags, which no check accepts)."""
    if tags is None:
        return [bytes(TAG_BYTES)] * nkeys
    if len(tags) != nkeys or not all(isinstance(t, (bytes, bytearray)) and len(t) == TAG_BYTES for t in tags):
        raise ValidationError(f"set_batch: tags must be {nkeys} values of {TAG_BYTES} bytes")
    return [bytes(t) for t in tags]


def check_batch(keys: Sequence[bytes], bufs: Sequence[Buffer], what: str) -> None:
    check_keys(keys)
    if len(keys) != len(bufs):
        raise ValidationError(f"{what}: {len(keys)} keys but {len(bufs)} buffers")


# -- fault injection --------------------------------------------------------------------------

FAULT_METHODS = ("exists_prefix", "get_batch", "set_batch")


@dataclass(frozen=True)
class FaultPlan:
    """Where a `FaultyBackend` fails or stalls, reproducibly.

    Calls are numbered from 1 over the methods in ``methods`` (one counter shared by them, in
    the order the wrapper sees them). At call ``n``:

    - ``n in fail_at`` or a seeded draw below ``fail_rate``: the call fails. ``mode="raise"``
      raises `StorageError`; ``mode="miss"`` returns a miss (``0`` / all ``False``) without
      touching the inner backend.
    - ``n in stall_at``: sleep ``stall_at[n]`` seconds, then go on; a seeded draw below
      ``stall_rate`` sleeps ``stall_s``.
    - ``n in hold_at``: block until `FaultyBackend.release()` (a controllable delay), then go on.
    - otherwise the call is forwarded; then each page of a forwarded ``get_batch``/``set_batch``
      independently fails with probability ``page_fail_rate`` (its result forced to ``False``; a
      failed set is not forwarded for that page).

    The draws for call ``n`` come from ``random.Random(f"{seed}:{n}")``, so the same plan and call
    order give the same faults in every run, whatever threads did in between.
    """

    fail_at: frozenset[int] = frozenset()
    stall_at: Mapping[int, float] = field(default_factory=dict)
    hold_at: frozenset[int] = frozenset()
    fail_rate: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 0.0
    page_fail_rate: float = 0.0
    mode: str = "raise"
    seed: int = 0
    methods: frozenset[str] = frozenset(FAULT_METHODS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fail_at", frozenset(self.fail_at))
        object.__setattr__(self, "hold_at", frozenset(self.hold_at))
        object.__setattr__(self, "methods", frozenset(self.methods))
        if self.mode not in ("raise", "miss"):
            raise ValidationError(f"FaultPlan.mode must be 'raise' or 'miss', got {self.mode!r}")
        unknown = self.methods - set(FAULT_METHODS)
        if unknown:
            raise ValidationError(f"FaultPlan.methods has unknown names {sorted(unknown)}")
        for name in ("fail_rate", "stall_rate", "page_fail_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValidationError(f"FaultPlan.{name} must be in [0, 1]")


@dataclass(frozen=True, slots=True)
class FaultEvent:
    call: int
    method: str
    outcome: str  # "ok", "failed", "stalled", "held", "partial"
    pages: int


class FaultyBackend:
    """Wraps a backend and injects failures, stalls and holds by `FaultPlan` (for tests)."""

    # every read goes through the faultable exists_prefix + get_batch (never the inner backend's
    # one-pass get_prefix, nor an inline existence probe on the event loop that a hold would block)
    get_prefix = None
    exists_is_local = False

    def __init__(self, inner: StorageBackend, plan: FaultPlan | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.plan = plan or FaultPlan()
        self.page_bytes = inner.page_bytes
        self._sleep = sleep
        self._lock = threading.Lock()
        self._count = 0
        self._gate = threading.Event()
        self._holding = 0
        self._held_cond = threading.Condition(self._lock)
        self.events: list[FaultEvent] = []

    # -- controls ------------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        with self._lock:
            return self._count

    def release(self) -> None:
        """Let every held call (and every later ``hold_at`` call) go on."""
        self._gate.set()

    def rearm(self) -> None:
        """Make later ``hold_at`` calls block again."""
        self._gate.clear()

    def wait_held(self, n: int = 1, timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` calls are blocked in a hold."""
        with self._held_cond:
            return self._held_cond.wait_for(lambda: self._holding >= n, timeout)

    # -- plumbing ------------------------------------------------------------------------------
    def _enter(self, method: str) -> tuple[int, random.Random | None, bool]:
        if method not in self.plan.methods:
            return 0, None, False
        with self._lock:
            self._count += 1
            n = self._count
        plan = self.plan
        rng = random.Random(f"{plan.seed}:{n}")
        fail = n in plan.fail_at or (plan.fail_rate > 0 and rng.random() < plan.fail_rate)
        stall = plan.stall_at.get(n, 0.0)
        if plan.stall_rate > 0 and rng.random() < plan.stall_rate:
            stall = max(stall, plan.stall_s)
        if n in plan.hold_at:
            self._record(n, method, "held", 0)
            with self._held_cond:
                self._holding += 1
                self._held_cond.notify_all()
            try:
                self._gate.wait()
            finally:
                with self._held_cond:
                    self._holding -= 1
        if stall > 0:
            self._record(n, method, "stalled", 0)
            self._sleep(stall)
        return n, rng, fail

    def _record(self, n: int, method: str, outcome: str, pages: int) -> None:
        with self._lock:
            self.events.append(FaultEvent(n, method, outcome, pages))

    def _fail(self, n: int, method: str, pages: int) -> None:
        self._record(n, method, "failed", pages)
        if self.plan.mode == "raise":
            raise StorageError(f"injected fault at call {n} ({method})")

    # -- protocol ------------------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        n, _rng, fail = self._enter("exists_prefix")
        if fail:
            self._fail(n, "exists_prefix", len(keys))
            return 0
        result = self.inner.exists_prefix(keys)
        if n:
            self._record(n, "exists_prefix", "ok", len(keys))
        return result

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        n, rng, fail = self._enter("get_batch")
        if fail:
            self._fail(n, "get_batch", len(keys))
            return [False] * len(keys)
        result = list(self.inner.get_batch(keys, dests, tags))
        return self._page_faults(n, rng, "get_batch", result)

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                  tags: Sequence[bytes] | None = None) -> list[bool]:
        n, rng, fail = self._enter("set_batch")
        if fail:
            self._fail(n, "set_batch", len(keys))
            return [False] * len(keys)
        if rng is not None and self.plan.page_fail_rate > 0:
            drop = [rng.random() < self.plan.page_fail_rate for _ in keys]
            keep = [i for i, d in enumerate(drop) if not d]
            inner = self.inner.set_batch([keys[i] for i in keep], [srcs[i] for i in keep],
                                         None if tags is None else [tags[i] for i in keep]) if keep else []
            result = [False] * len(keys)
            for i, ok in zip(keep, inner):
                result[i] = bool(ok)
            self._record(n, "set_batch", "partial" if any(drop) else "ok", len(keys))
            return result
        result = list(self.inner.set_batch(keys, srcs, tags))
        if n:
            self._record(n, "set_batch", "ok", len(keys))
        return result

    def _page_faults(self, n: int, rng: random.Random | None, method: str, result: list[bool]) -> list[bool]:
        if rng is None:
            return result
        if self.plan.page_fail_rate > 0:
            drops = [rng.random() < self.plan.page_fail_rate for _ in result]
            result = [ok and not d for ok, d in zip(result, drops)]
            self._record(n, method, "partial" if any(drops) else "ok", len(result))
        else:
            self._record(n, method, "ok", len(result))
        return result

    def close(self) -> None:
        self.release()
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        s = dict(self.inner.stats())
        with self._lock:
            s["faults"] = {
                "calls": self._count,
                "failed": sum(1 for e in self.events if e.outcome == "failed"),
                "stalled": sum(1 for e in self.events if e.outcome == "stalled"),
                "held": sum(1 for e in self.events if e.outcome == "held"),
            }
        return s

    def __getattr__(self, name: str) -> Any:
        # everything else (register_buffer, directory, ...) goes to the wrapped backend
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def closed_error(name: str) -> StateError:
    return StateError(f"{name} is closed")


# -- closing with calls in flight ---------------------------------------------------------------

class CallGate:
    """A backend's calls in flight, and how it closes while some are still inside it.

    Every public call runs inside the gate (`gated`). `close(teardown, timeout_s)` shuts the gate
    (a call that starts later raises `StateError`) and hands `teardown` (what frees the backend's
    resources: a store handle, registered memory, file descriptors) to a thread of its own that
    first waits until the last call in flight has left: a resource is never freed under a running
    call, however long that call takes (a Mooncake call to a dead master returns after its RPC
    timeout). `close` waits for that thread at most `timeout_s`; past it, it returns and the
    calls still inside are *abandoned* (`abandoned` counts them): the teardown runs when they
    return. The thread is not a daemon, so the process waits for it at exit instead of unloading
    the backend's library under it. (A thread held in a call is not killed: Python cannot.)"""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._running = 0
        self._closed = False
        self._torn_down = threading.Event()
        self.abandoned = 0  # calls still in flight when close() returned

    @property
    def running(self) -> int:
        with self._cond:
            return self._running

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def torn_down(self) -> bool:
        return self._torn_down.is_set()

    def enter(self) -> None:
        with self._cond:
            if self._closed:
                raise closed_error(self.name)
            self._running += 1

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            if self._running == 0:
                self._cond.notify_all()

    def close(self, teardown: Callable[[], None], timeout_s: float) -> bool:
        """Shut the gate and tear down once no call is inside; True when the teardown finished
        within `timeout_s`. A second close waits for nothing and returns whether it is done."""
        with self._cond:
            if self._closed:
                return self.torn_down
            self._closed = True
        worker = threading.Thread(target=self._teardown_when_idle, args=(teardown,),
                                  name=f"hicache-{self.name}-close", daemon=False)
        worker.start()
        if self._torn_down.wait(timeout_s):
            return True
        with self._cond:
            self.abandoned = self._running
        return False

    def _teardown_when_idle(self, teardown: Callable[[], None]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0)
        try:
            teardown()
        except Exception as exc:  # noqa: BLE001 - nobody to raise to: the close returned already
            _log.warning("storage_teardown_failed", backend=self.name, error=repr(exc))
        finally:
            self._torn_down.set()

    def stats(self) -> dict[str, Any]:
        return {"calls_running": self.running, "calls_abandoned_at_close": self.abandoned,
                "torn_down": self.torn_down}


_F = TypeVar("_F", bound=Callable[..., Any])


def gated(method: _F) -> _F:
    """Run a backend method inside its `CallGate` (``self._gate``): `StateError` once closed."""
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        gate: CallGate = self._gate
        gate.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            gate.leave()
    return call  # type: ignore[return-value]
