"""A fake prefill peer for the API fuzzer: `PeerBackend`'s surface, no ZMQ, no model, seeded faults.

A decode runtime opened with ``storage=FakePeer(...)`` sees what it sees of a `PeerBackend`
(runtime/disagg/peer_backend.py): a read-only backend (`read_only`, `exists_is_local`) whose
lookups answer from the prompts announced with `expect` (PeerBackend's own `ExpectedPages`: the
same page hashes, the same runs of one prompt's consecutive pages, the same cap on what it keeps)
and whose reads "fill" the leading expected pages asked for: the fuzzer's fingerprint KV
(`runtime.fingerprint`, what the harness writes as the model) of those tokens, written into the
destinations in the storage page form ``[L, C, page_size, H, D]`` with their `PageSeal` tags under
the runtime's storage key. That one write stands in for the prefill side's compute and the
transport's transfer.

Faults, drawn per fill from ``random.Random(f"{seed}:{n}")`` (n: the fill's number), at the rates
of `PeerFaults`:

- drop: the fill fails (`StorageError`, as `PeerBackend` raises for a `Failed` answer, a cancel, a
  silent peer) after garbage landed in some of the destinations (a write that failed half-way);
- delay: it sleeps before writing, half the time a little and half the time `slow_s` give or take
  (past the runtime's ``storage_timeout_s``: the read goes overdue, and its pages are written late);
- size: it answers more pages than asked (out of contract: the whole read a miss), more than it
  wrote (pages with no tag), or fewer (garbage in the pages past them);
- tag: one page's tag is wrong: random bytes, the tag of another page's key, a tag made with the
  wrong key (unkeyed where the runtime is keyed, or the reverse), or the right tag over bytes
  corrupted in flight.

Whatever it does, every read must end with the right KV or a miss: the fuzzer's oracles (served
KV, tree copies, ledgers after every call and at rest) are unchanged. As with PeerBackend, `expect`
and `exists_prefix` (the transfer actor's inline probe, on its event loop) never wait for a fill in
flight: a slow fill runs past the runtime's deadline while its event loop goes on.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.config import RuntimeConfig
from runtime.disagg.peer_backend import ExpectedPages
from runtime.errors import StateError
from runtime.fingerprint import fingerprint_kv, prefix_hashes
from runtime.memory.pools import KVShape
from runtime.storage.backend import Buffer, StorageError, byte_view, check_keys
from runtime.storage.hashing import KVIdentity
from runtime.storage.integrity import TAG_BYTES, PageSeal

OTHER_KEY = "fake-peer: not the runtime's storage key"  # (the wrong key of a wrong-key tag)
COUNTERS = ("fills", "pages_filled", "drops", "delays", "late", "more_than_asked", "more_than_written", "fewer",
            "wrong_tags")


@dataclass(frozen=True)
class PeerFaults:
    """Rates per fill (each drawn on its own) and the long delay."""

    drop: float = 0.0
    delay: float = 0.0
    size: float = 0.0
    tag: float = 0.0
    slow_s: float = 0.1  # a long delay, about this long (the runtime's storage_timeout_s is shorter)
    seed: int = 0


class FakePeer:
    read_only = True  # it stores nothing: the storage tier's writes are skipped
    exists_is_local = True  # `exists_prefix` reads what `expect` recorded

    def __init__(self, config: RuntimeConfig, faults: PeerFaults = PeerFaults(),
                 max_expected_pages: int = 1 << 16) -> None:
        """A peer for a decode runtime of `config` (its KV geometry, page size and storage key)."""
        self.page_size = config.page_size
        self.page_bytes = config.page_size * config.bytes_per_token
        self.shape = KVShape(config.num_layers, config.num_kv_heads, config.head_dim, config.torch_dtype,
                             parts=config.kv_parts)
        self.seal = PageSeal(config.storage_key)
        self.wrong_seal = PageSeal(None if config.storage_key is not None else OTHER_KEY)
        self.faults = faults
        self.expected = ExpectedPages(KVIdentity.from_config(config), config.page_size, max_expected_pages)
        self._lock = threading.Lock()  # the counters (reads run in worker threads; `expected` has its own)
        self._fills = itertools.count(1)
        self.closed = False
        self.counters = dict.fromkeys(COUNTERS, 0)

    # -- what the caller tells it ----------------------------------------------------------------
    def expect(self, tokens: Sequence[int] | np.ndarray, extra_key: Hashable = None) -> int:
        """As `PeerBackend.expect`: the pages of `tokens` (all but the last token's) are found here."""
        return self.expected.add(np.asarray(tokens, dtype=np.int32), extra_key)

    # -- the storage backend's calls -------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        return len(self.expected.run(keys))

    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer], tags: list[bytes | None] | None = None) -> int:
        """Fill the leading expected pages of `keys` into `dests` (their tags into `tags`); returns
        how many it says it wrote, faults included."""
        check_keys(keys)
        if self.closed:
            raise StateError("the fake prefill peer is closed")
        rng = random.Random(f"{self.faults.seed}:{next(self._fills)}")
        run, first = self.expected.first_run(keys)
        if first is None or not run:
            return 0
        f = self.faults
        if rng.random() < f.delay:
            late = rng.random() < 0.5
            self._count("late" if late else "delays")
            time.sleep(f.slow_s * rng.uniform(0.75, 1.5) if late else rng.uniform(0.0, 0.005))
        pages = self._pages(first.tokens, first.extra_key, first.index, len(run))
        views = [byte_view(d, self.page_bytes, writable=True) for d in dests[:len(run)]]
        if rng.random() < f.drop:
            for view in views[:rng.randint(0, len(views))]:  # (a write that failed half-way)
                view[:] = rng.randbytes(self.page_bytes)
            self._count("drops")
            raise StorageError(f"injected: the prefill peer failed to fill {len(run)} pages")
        for view, page in zip(views, pages):
            view[:] = page.tobytes()
        out = [self.seal.tag(k, p) for k, p in zip(run, pages)]
        if rng.random() < f.tag:
            self._wrong_tag(rng, run, pages, views, out)
        n = len(run)
        if rng.random() < f.size:
            n = self._wrong_size(rng, len(keys), views, out)
        if tags is not None:
            want = min(len(tags), n)
            tags[:want] = (out + [None] * want)[:want]
        self._count("fills")
        self._count("pages_filled", len(out))
        return n

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        n = self.get_prefix(keys, dests, tags)
        return [i < n for i in range(len(keys))]

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                  tags: Sequence[bytes] | None = None) -> list[bool]:
        return [False] * len(keys)  # (never called: `read_only`)

    def close(self) -> None:
        self.closed = True

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters)
        return {"backend": "fake_prefill_peer", "expected_pages": len(self.expected.pages), **counters}

    # -- helpers ---------------------------------------------------------------------------------
    def _pages(self, tokens: np.ndarray, extra_key: Hashable, index: int, count: int) -> list[np.ndarray]:
        """The fingerprint KV of pages [index, index + count) of `tokens`, each as its page bytes."""
        ps, s = self.page_size, self.shape
        lo, hi = index * ps, (index + count) * ps
        hashes = prefix_hashes(tokens[:hi], extra_key)[lo:]
        kv = fingerprint_kv(hashes, s.num_layers, s.num_kv_heads, s.head_dim, s.dtype, s.parts).to(s.dtype)
        return [kv[:, :, j * ps:(j + 1) * ps].contiguous().view(torch.uint8).numpy().reshape(-1) for j in range(count)]

    def _wrong_tag(self, rng: random.Random, run: list[bytes], pages: list[np.ndarray], views: list[memoryview],
                   out: list[bytes]) -> None:
        """One page's tag does not fit the bytes that landed under its key."""
        j = rng.randrange(len(run))
        kind = rng.randrange(4)
        if kind == 0:
            out[j] = rng.randbytes(TAG_BYTES)
        elif kind == 1:  # (the right bytes under another key: a page misplaced)
            out[j] = self.seal.tag(run[j][::-1], pages[j])
        elif kind == 2:
            out[j] = self.wrong_seal.tag(run[j], pages[j])
        else:  # the right tag, a byte flipped in flight
            at = rng.randrange(self.page_bytes)
            views[j][at] ^= 1 << rng.randrange(8)
        self._count("wrong_tags")

    def _wrong_size(self, rng: random.Random, asked: int, views: list[memoryview], out: list[bytes]) -> int:
        """A count that is not what was written: more than asked, more than written (those pages
        have no tag), or fewer (garbage lands past them)."""
        kind = rng.randrange(3)
        if kind == 0:
            self._count("more_than_asked")
            return asked + rng.randint(1, 3)
        if kind == 1 and len(out) < asked:
            self._count("more_than_written")
            return rng.randint(len(out) + 1, asked)
        n = rng.randrange(len(out))
        for view in views[n:]:
            if rng.random() < 0.5:
                view[:] = rng.randbytes(self.page_bytes)
        self._count("fewer")
        return n

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n
