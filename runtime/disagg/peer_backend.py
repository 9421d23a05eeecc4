"""PeerBackend: a decode runtime's prefill peer, seen by its storage tier as a read-only backend.

Prefill/decode disaggregation on the runtime's own path: a decode runtime opened with
``storage=PeerBackend(...)`` matches a prompt against its device and host tiers as always; its
storage tier then looks up the pages beyond that hit here, and reads them: the read asks the
prefill runtime (`PrefillServer`) to compute the prompt's KV and write those pages, and only
those, straight into the host pages the read reserved (the transport, `runtime.disagg.transport`:
Mooncake's Transfer Engine, or an in-process stand-in). A full hit asks nothing. The pages land
as a storage read's do: pinned and owned by the read until it returns (or, past its deadline,
until its call returns: a late transfer still lands in pages nobody reused), each checked against
its integrity tag, then host copies in the tree, loaded to the device like any host hit.

Which prompt a page belongs to: the caller announces each prompt (`expect`) before it asks the
runtime for it (`prepare` / `admit`, or a `ServingLoop` submit); the page hashes the tier looks up
are that prompt's, so the peer knows the tokens to compute. A page the peer was not told of is
absent (the decode side computes it).

Faults: a peer that does not answer in `timeout_s`, answers out of turn, writes fewer pages or
pages whose tags fail, or drops the connection, gives a shorter read or a failed one: the decode
side computes the rest itself; nothing it holds leaks (the read's pages are the storage tier's).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from runtime.errors import ConfigError
from runtime.disagg.protocol import (Cancel, Cancelled, Failed, Fill, Filled, Hello, Refused, Welcome, decode, encode,
                                     identity_fields)
from runtime.storage.backend import Buffer, StorageError, byte_view, check_keys
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.trace import get_logger

_log = get_logger("hicache.disagg")


@dataclass(frozen=True, slots=True)
class _Page:
    """Where an expected page comes from: its prompt (tokens, extra key) and its index in it."""

    tokens: np.ndarray
    extra_key: Any
    index: int


class ExpectedPages:
    """The pages of the prompts the caller announced, by page hash (the most recent
    `max_pages`): which prompt each belongs to, and where in it."""

    def __init__(self, identity: KVIdentity, page_size: int, max_pages: int) -> None:
        self.identity = identity
        self.page_size = page_size
        self.max_pages = max_pages
        self.pages: OrderedDict[bytes, _Page] = OrderedDict()
        self._lock = threading.Lock()  # (short: no I/O under it)

    def add(self, tokens: np.ndarray, extra_key: Hashable) -> int:
        whole = (len(tokens) - 1) // self.page_size * self.page_size
        if whole <= 0:
            return 0
        prompt = tokens[:whole]  # (one array: a run of pages is pages of the same one)
        keys = page_hashes(prompt, self.page_size, extra_key, self.identity)
        with self._lock:
            for i, key in enumerate(keys):
                self.pages[key] = _Page(prompt, extra_key, i)
                self.pages.move_to_end(key)
            while len(self.pages) > self.max_pages:
                self.pages.popitem(last=False)
        return len(keys)

    def run(self, keys: Sequence[bytes]) -> list[bytes]:
        """The leading keys expected as consecutive pages of one prompt."""
        return self.first_run(keys)[0]

    def first_run(self, keys: Sequence[bytes]) -> tuple[list[bytes], _Page | None]:
        """`run(keys)` and the page record of its first key."""
        with self._lock:
            first = self.pages.get(bytes(keys[0])) if keys else None
            if first is None:
                return [], None
            run = []
            for i, key in enumerate(keys):
                page = self.pages.get(bytes(key))
                if page is None or page.tokens is not first.tokens or page.index != first.index + i:
                    break
                run.append(bytes(key))
            return run, first


class PeerBackend:
    read_only = True  # it stores nothing: the storage tier issues no write to it
    exists_is_local = True  # `exists_prefix` reads what `expect` recorded: no network

    def __init__(self, endpoint: str, transport: Any, identity: KVIdentity, page_size: int, page_bytes: int, *,
                 keyed: bool = False, timeout_s: float = 30.0, connect_timeout_s: float = 10.0,
                 cancel_grace_s: float = 2.0, dead_grace_s: float = 6.0, max_expected_pages: int = 1 << 16) -> None:
        """Connect to the prefill side at `endpoint` (a ZMQ address, e.g. tcp://127.0.0.1:5600)
        and agree on the layout (`ConfigError` naming what differs). `keyed`: this runtime's
        pages are tagged with a storage key (`RuntimeConfig.storage_key` set). A fill not answered
        in `timeout_s` is cancelled; a peer that answers neither within `cancel_grace_s` is taken
        for gone, and the read's pages are held `dead_grace_s` more (a transport's deadline: a
        write it started may still land) before the read fails."""
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.transport = transport
        self.timeout_s, self.cancel_grace_s, self.dead_grace_s = timeout_s, cancel_grace_s, dead_grace_s
        self.expected = ExpectedPages(identity, page_size, max_expected_pages)
        self._lock = threading.Lock()  # one request on the socket at a time (held while it waits)
        # the expected pages' own: `expect` and `exists_prefix` run on the event loop (a lookup's
        # inline probe) and must never wait for a fill in flight
        self._reqs = itertools.count(1)
        self._registered: list[tuple[int, int]] = []  # (address, bytes) of buffers the transport has
        self._endpoint = endpoint
        self._closed = False
        self._sock = self._connect()
        self.peer_session = self._hello(keyed, connect_timeout_s)
        self.counters = dict.fromkeys(("fills", "pages_filled", "fill_failures", "fill_timeouts", "peer_silent",
                                       "bytes_filled"), 0)

    # -- what the caller tells it ----------------------------------------------------------------
    def expect(self, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> int:
        """The caller is about to ask the runtime for `tokens`: record its pages (all but the last
        token's, as a prefetch reads them) so that a lookup of their hashes finds them here.
        Returns the pages recorded."""
        return self.expected.add(np.asarray(tokens, dtype=np.int32), extra_key)

    # -- the storage backend's calls -------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        return len(self.expected.run(keys))

    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer], tags: list[bytes | None] | None = None) -> int:
        """Ask the prefill side for the leading expected pages of `keys`, written into `dests`;
        returns how many it wrote (their tags into `tags`)."""
        check_keys(keys)
        run, first = self.expected.first_run(keys)
        if not run:
            return 0
        with self._lock:
            addrs = [self._address(d) for d in dests[:len(run)]]
            req = next(self._reqs)
            end = (first.index + len(run)) * self.page_size
            fill = Fill(req, first.tokens[:end].astype("<i4").tobytes(), first.extra_key, first.index, len(run),
                        [bytes(k) for k in run], addrs, self.transport.session)
            try:
                reply = self._ask(fill, req)
            finally:
                if self._closed:
                    self._sock.close(linger=0)
            n = self._checked(reply, len(run))  # (counted under the lock: worker threads share the counters)
        if tags is not None:
            tags[:n] = reply.tags[:n]
        return n

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        n = self.get_prefix(keys, dests, tags)
        return [i < n for i in range(len(keys))]

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer], tags: Sequence[bytes] | None = None) -> list[bool]:
        return [False] * len(keys)  # (never called: `read_only`)

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """The host pool the reads land in (the transfer actor registers a page_first pool)."""
        self.transport.register(buffer)
        self._registered.append((buffer.data_ptr(), buffer.numel() * buffer.element_size()))

    def unregister_buffer(self, buffer: torch.Tensor) -> None:
        self.transport.unregister(buffer)
        self._registered = [r for r in self._registered if r[0] != buffer.data_ptr()]

    def close(self) -> None:
        """Close the connection now, or, while a fill waits on it (a call the runtime abandoned at
        its close), once that fill ends: a close never waits for the peer."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._sock.close(linger=0)
            finally:
                self._lock.release()

    def stats(self) -> dict[str, Any]:
        return {"backend": "prefill_peer", "peer": self._endpoint, "expected_pages": len(self.expected.pages),
                **self.counters}

    # -- helpers ---------------------------------------------------------------------------------
    def _connect(self) -> Any:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        return sock

    def _hello(self, keyed: bool, timeout_s: float) -> str:
        hello = Hello(identity_fields(self.expected.identity), self.page_size, self.page_bytes, keyed, self.transport.session)
        self._sock.send(encode(hello))
        if not self._sock.poll(int(timeout_s * 1000)):
            self._sock.close(linger=0)
            raise StorageError(f"no prefill peer answered at {self._endpoint} in {timeout_s} s")
        reply = decode(self._sock.recv())
        if isinstance(reply, Refused):
            self._sock.close(linger=0)
            raise ConfigError(f"the prefill peer at {self._endpoint} refused this decode runtime: {reply.reason}")
        if not isinstance(reply, Welcome):
            self._sock.close(linger=0)
            raise StorageError(f"the prefill peer at {self._endpoint} answered {type(reply).__name__} to Hello")
        _log.info("prefill_peer_connected", endpoint=self._endpoint, session=reply.session)
        return reply.session

    def _checked(self, reply: Any, asked: int) -> int:
        """The pages a fill's answer says were written, checked against what was asked (counted)."""
        if isinstance(reply, Failed):
            self.counters["fill_failures"] += 1
            raise StorageError(f"the prefill peer failed to fill {asked} pages: {reply.reason}")
        n = reply.pages if isinstance(reply, Filled) else None
        if not isinstance(n, int) or not 0 <= n <= asked or len(reply.tags) < n:
            self.counters["fill_failures"] += 1
            raise StorageError(f"the prefill peer answered {type(reply).__name__} ({n!r} pages) for {asked} asked")
        self.counters["fills"] += 1
        self.counters["pages_filled"] += n
        self.counters["bytes_filled"] += n * self.page_bytes
        return n

    def _address(self, dest: Buffer) -> int:
        """A destination page's address, inside a buffer registered with the transport."""
        view = byte_view(dest, self.page_bytes, writable=True)
        addr = int(np.frombuffer(view, np.uint8).ctypes.data)  # (a view: the destination's own memory)
        if not any(a <= addr and addr + self.page_bytes <= a + n for a, n in self._registered):
            raise StorageError("a read's destination is not in a registered host pool: open the decode runtime "
                               "with host_layout='page_first'")
        return addr

    def _ask(self, fill: Fill, req: int) -> Any:
        """Send `fill` and wait for its answer. Past `timeout_s`, cancel it and wait for the cancel's
        answer (or the fill's own, when its write had started); a peer that answers neither may
        still be writing into the read's pages: this call (which keeps them pinned) returns only
        `dead_grace_s` later, past the transport's own deadline."""
        self._sock.send(encode(fill))
        reply = self._wait(req, self.timeout_s)
        if reply is not None:
            return reply
        self.counters["fill_timeouts"] += 1
        self._sock.send(encode(Cancel(req)))
        reply = self._wait(req, self.cancel_grace_s)
        if isinstance(reply, Cancelled):
            raise StorageError(f"the prefill peer did not fill {fill.pages} pages in {self.timeout_s} s (cancelled)")
        if reply is not None:
            return reply
        self.counters["peer_silent"] += 1
        _log.warning("prefill_peer_silent", endpoint=self._endpoint, req=req, grace_s=self.dead_grace_s)
        time.sleep(self.dead_grace_s)
        self._sock.close(linger=0)  # (a fresh socket: a late answer must not be taken for the next request's)
        self._sock = self._connect()
        raise StorageError(f"the prefill peer at {self._endpoint} answered neither a fill nor its cancel")

    def _wait(self, req: int, seconds: float) -> Any:
        """The answer to request `req` within `seconds` (None: none); answers to earlier,
        abandoned requests are dropped."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                return None
            reply = decode(self._sock.recv())
            if getattr(reply, "req", None) == req:
                return reply
            _log.debug("prefill_peer_stale_answer", req=getattr(reply, "req", None), waiting_for=req)
