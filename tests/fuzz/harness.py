"""Model-based fuzzer of `CacheRuntime`'s public API.

One *episode* opens a runtime with a configuration drawn from a seed (page size 1/4/16, a
write policy, storage off / file / faulty file, decode offload, the fake or the CPU copy engine,
copy faults, tiny pools so that eviction, load-back and prefetch happen all the time, and always
`debug_invariants=True`), then runs a few hundred API calls drawn from a small vocabulary of
shared prefixes (system prompts, multi-turn conversations that extend earlier turns, some unique
prompts), mostly valid, some invalid, some cancelled after 0 or 1 loop turns; it ends by
releasing everything, checking that nothing leaked and closing.

Next to the runtime the harness keeps a *model*: for every live request its rid and generation,
its planned tokens (prompt, then what the "model" will generate), the device slot of every
position of its pages, its lengths (seq, committed, cached, token record) and how far the
harness has "computed" it; the same for sessions. The harness is the model step too: it writes
the fingerprint KV (`runtime.fingerprint`) of every position it computes before it commits,
caches or finishes it. From the model it predicts each call's outcome (an error class that must
come, or success with only `CapacityError` / `TransferError` allowed) and checks, after every
call:

- the runtime has not failed (no injected fault here makes a failure legitimate: storage errors
  and copy failures are errors the runtime promises to survive, and caller mistakes are
  `ValidationError`s);
- the invariant checker passes on the state at rest (`rt.inspect(check_invariants)`);
- the runtime's request and session records equal the model (live set, generation, slots,
  lengths, token record) - a live request's slots never change, a cancelled admit leaves
  nothing, the token record only grows;
- every computed (and, once its readiness is done, every cached) position of every live request
  and session holds the fingerprint of that request's own token prefix; every tree node's ready
  device copy and host copy holds its prefix's (every `TREE_EVERY` calls and at the end);
- a call that raised a `ValidationError` changed nothing: the records and the pages owned by
  requests and sessions are equal before and after.
- storage controls (`clear_storage`, `detach_storage`, `attach_storage`, drawn in storage
  episodes, often with another step running while they drain): the tier is the one the calls
  made, nothing prefetches without it, the KV events announce what the tier (or the backend
  detached last) knows stored, and on file storage nothing is found stored that the runtime
  cannot have written since the last clear.
- pages lost behind the runtime's back (file storage: `evict_pages` deletes a few page files, as
  another process or a size cap would): every page file in the directory is one the tier knows
  stored, holds in doubt or is writing (what a clear would leave otherwise), and every page it
  knows stored is there unless the harness deleted it (every `TREE_EVERY` calls, after each
  clear and at the end).
- counters only grow: every counter (and histogram count) of every `stats()` the episode calls,
  the teardown's included, is at least what the one before said (storage controls among the
  steps: a detach and attach must not reset the storage counters).
- recurrent state (*hybrid* episodes, about 1 in 5: `FuzzConfig.state_slots` > 0, a few state
  slots, half with a host tier and a quarter with storage too, no decode offload or sessions; a
  snapshot prefetched from storage is checked like any other): the harness is the model's recurrent
  layers too. It writes a *state fingerprint* (`state_fingerprint`: the prefix hash of the
  request's own tokens so far, exact in each component) into every request's running state slot
  as it computes, and into every slot `snapshot` returns, the state after exactly that position;
  an admit that resumes from a snapshot (`state_from`) finds there the fingerprint of exactly its
  cached prefix (a hit with KV and no state is a violation too), and the harness copies it into
  the running slot as an engine would. The records compare running slots and pending snapshots
  with the model's (a running slot never changes while live, a returned slot belongs to nobody
  else), and after every call every running and pending slot holds its fingerprint and every
  tree node's snapshot the fingerprint of that node's whole path (they are few: at most the
  state slots).
- sliding-window layers (*sliding* episodes, about 1 in 6 of the others: `FuzzConfig.sliding_layers`,
  three layers of which one or two slide, a window of a few pages and often not page-aligned, a
  sliding pool smaller than the full one, with or without a host tier, no storage or decode
  offload): the harness writes the sliding layers' fingerprints at `rt.swa_map[slot]` in
  `rt.swa_pool` (the full ones in `rt.device_pool`), and its forward reads the window before the
  positions it computes through the map. Oracles: a running request's positions from its window's
  start (`committed - W + 1`) on never map to a dropped slot and, up to what it computed, hold its own
  prefix's sliding KV (at the forward and after every call); an admitted hit's window is present
  (the cut); every tree node's device pages with sliding KV hold their path's, those without are a
  leading run of the node, and its host copy's sliding part holds it on the pages its host record
  says have it (`tree-kv-content`, every `TREE_EVERY` calls).
- KV formats (about 1 in 4 of the mixed episodes without sliding layers, `_with_kv_format`): 16-
  and 8-bit pools (float16, bfloat16, float8_e4m3fn, float8_e5m2) and MLA's one latent per token;
  the fingerprints are exact in each (`runtime.fingerprint`), so every oracle holds as it is.
- peer episodes (a stream of their own, `peer_episode`, run by tests/fuzz/test_peer_fuzz.py): a
  decode runtime whose storage tier is a fake prefill peer (`tests.fuzz.fake_peer`: `PeerBackend`'s
  surface, fills written as the fingerprint KV with their page tags, seeded drops, delays past a
  short `storage_timeout_s`, wrong counts and wrong tags); the harness announces every prompt to
  it (`Driver.announce`, as a caller does with `PeerBackend.expect`) before admit or prepare.
  Every oracle holds as it is: a fill ends as the right KV or a miss.

Every episode is recorded as a list of steps `(name, args)`; a failing one is shrunk by delta
debugging (replaying recorded steps on a fresh runtime) and printed as a replay line and a
Python step list. Episodes on the fake copy engine without storage are deterministic (copies
complete only when a `release` step says so, and the step waits for the ack); storage threads
and the CPU engine are not, and replays of those may need a few tries (the shrinker retries).
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from runtime.config import RuntimeConfig
from runtime.events import CPU, GPU, STORAGE, PrefixIndex
from runtime.errors import (
    ArgumentError,
    CallerError,
    CapacityError,
    ConfigError,
    DuplicateRequestError,
    LengthError,
    RuntimeClosed,
    StateError,
    TokenError,
    TransferError,
    UnknownRequestError,
    ValidationError,
)
from runtime.fingerprint import fingerprint_kv, prefix_hashes
from runtime.invariants import check_invariants
from runtime.memory.state_pool import StateShape
from runtime.messages import Abort, Admit, AdmitResult, Cache, Commit, Direction, Extend, Finish
from runtime.runtime import CacheRuntime
from runtime.stats import STATS, Kind
from runtime.storage.backend import FaultPlan, FaultyBackend
from runtime.storage.file_backend import FileBackend
from runtime.storage.page_directory import FANOUT, PAGE_SUFFIX
from runtime.storage.hashing import KVIdentity, page_hashes
from runtime.transfer.cpu_engine import CpuCopyEngine
from runtime.transfer.fake_engine import FakeCopyEngine
from runtime.tree.records import StoredPages
from tests.fuzz.fake_peer import FakePeer, PeerFaults

Step = tuple[str, dict[str, Any]]

VOCAB = 500  # token ids: small, so that unrelated prompts still share first tokens now and then
TREE_EVERY = 16  # API calls between two checks of every tree node's KV
CALL_TIMEOUT_S = 20.0  # a call that takes longer hangs (copies are released by the harness)
NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 1, 2  # two layers: per-layer readiness matters; the rest is cost
# hybrid episodes: two recurrent layers with a conv and an SSM state each (a slot is small: the
# rule is what is tested, not the copy)
STATE_LAYERS, STATE_COMPONENTS = 2, "conv:3x2:float32,ssm:2x2:float32"
HYBRID_SHARE = 0.2  # of episodes (`generate_episode`)
# sliding episodes: three layers, one or two of them sliding (a sliding pool with more layers than
# the full one exercises per-layer readiness of copies with fewer layers than the model)
SWA_LAYERS = 3
SWA_LAYER_SETS = ("0", "1", "2", "0,2", "1,2")
SWA_SHARE = 0.4  # of the mixed episodes without storage or decode offload (about 1 in 6 non-hybrid ones)
KV_FORMAT_SHARE = 0.25  # of the mixed episodes without sliding layers: another KV dtype or MLA (`_with_kv_format`)
KV_FORMAT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")  # float32 with "mla" only


class Violation(AssertionError):
    """The runtime broke a promise; `kind` names the oracle (shrinking keeps the kind)."""

    def __init__(self, kind: str, detail: str, step: int | None = None) -> None:
        super().__init__(f"[{kind}] at step {step}: {detail}")
        self.kind, self.detail, self.step = kind, detail, step


class _Cancelled:
    """The call's task was cancelled by the harness (its outcome is the runtime's to clean up)."""


CANCELLED = _Cancelled()


# -- configuration ------------------------------------------------------------------------------



def _prefetches(core: Any) -> dict:
    return core.storage.prefetches


def _retired(core: Any) -> dict:
    return core.offload.retired

@dataclass(frozen=True)
class FuzzConfig:
    page_size: int = 4
    device_pages: int = 12
    host_pages: int = 16
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    host_layout: str = "layer_first"
    storage: str = "none"  # none | file | faulty
    storage_fail_rate: float = 0.0
    storage_page_fail_rate: float = 0.0
    storage_fault_mode: str = "raise"
    prefetch_policy: str = "wait_complete"
    decode_offload: bool = False
    offload_stride_pages: int = 1
    engine: str = "fake"  # fake: copies land when a `release` step says so; cpu: worker threads
    copy_faults: bool = False  # fake: `release` steps may fail a copy; cpu: a seeded fault hook
    # a patient caller waits for a request's loads (its readiness) before computing past its cached
    # prefix, as a model must; an impatient one computes, commits and caches while they run
    impatient: bool = False
    fault_seed: int = 0
    calls: int = 300  # API calls in a generated episode
    # "loads": few conversations, a large host pool and copy faults: prefixes go host-only and
    # come back often, loads start under loads and fail (the host->device path's rollbacks)
    focus: str = "mixed"
    # > 0: a hybrid model's recurrent state in this many device state slots (`draw_config`)
    state_slots: int = 0
    host_state_slots: int | None = None  # host copies of snapshots (None: the runtime's default)
    # sliding-window layers (`_with_sliding`): "" none, else the indices of SWA_LAYERS that slide, the
    # window in tokens (not page-aligned as a rule) and the sliding pool's pages
    sliding_layers: str = ""
    sliding_window: int = 0
    swa_pages: int = 0
    # the KV pools' dtype and layout (`_with_kv_format`): "mla" keeps one latent per token
    kv_dtype: str = "float32"
    kv_layout: str = "mha"
    # the storage tier's deadline of one backend call and its page tags' key (the runtime's defaults
    # but in peer episodes, `draw_peer_config`)
    storage_timeout_s: float = 5.0
    storage_key: str | None = None
    # storage "peer": a fake prefill peer (`tests.fuzz.fake_peer`), its faults' rates per fill and the
    # announced pages it keeps (`PeerBackend`'s `max_expected_pages`)
    peer_drop_rate: float = 0.0
    peer_delay_rate: float = 0.0
    peer_size_rate: float = 0.0
    peer_tag_rate: float = 0.0
    peer_expected_pages: int = 1 << 16

    @property
    def hybrid(self) -> bool:
        return self.state_slots > 0

    @property
    def sliding(self) -> bool:
        return bool(self.sliding_layers)

    @property
    def num_layers(self) -> int:
        return SWA_LAYERS if self.sliding else NUM_LAYERS

    @property
    def device_slots(self) -> int:
        return self.page_size * self.device_pages

    @property
    def deterministic(self) -> bool:
        return self.engine == "fake" and self.storage == "none"

    def runtime_config(self) -> RuntimeConfig:
        ps = self.page_size
        return RuntimeConfig(
            num_layers=self.num_layers, num_kv_heads=NUM_HEADS, head_dim=HEAD_DIM, kv_dtype=self.kv_dtype,
            kv_layout=self.kv_layout,
            page_size=ps, device_slots=self.device_slots, host_tokens=self.host_pages * ps,
            host_layout=self.host_layout, write_policy=self.write_policy, write_through_threshold=2,
            eviction_policy=self.eviction_policy, copy_engine="cpu", copy_workers=1,
            decode_offload=self.decode_offload,
            offload_stride=self.offload_stride_pages * ps if self.decode_offload else None,
            prefetch_policy=self.prefetch_policy, prefetch_timeout_base_s=0.05, prefetch_timeout_max_s=0.2,
            storage_timeout_s=self.storage_timeout_s, storage_key=self.storage_key,
            debug_invariants=True, kv_events=True,
            **({"state_layers": STATE_LAYERS, "state_components": STATE_COMPONENTS, "state_slots": self.state_slots,
                "host_state_slots": self.host_state_slots if self.host_pages else None}
               if self.hybrid else {}),
            **({"sliding_layers": self.sliding_layers, "sliding_window": self.sliding_window,
                "swa_tokens": self.swa_pages * ps} if self.sliding else {}))


def draw_config(rng: random.Random, hybrid: bool = False) -> FuzzConfig:
    """An episode's configuration; `hybrid`: with recurrent state (no decode offload, as the runtime
    has it; half of them with a host tier, whose snapshot copies travel with their nodes' backups
    and loads, and half of those with a storage tier, where snapshots are written and prefetched
    with their nodes' KV; a few state slots on each tier, so that snapshots are evicted and admits
    and snapshots meet CapacityError)."""
    ps = rng.choice((1, 4, 4, 16))
    device_pages = {1: rng.randint(16, 40), 4: rng.randint(6, 16), 16: rng.randint(3, 8)}[ps]
    if hybrid:
        host_pages = 0 if rng.random() < 0.5 else rng.randint(device_pages, 3 * device_pages)
        cfg = FuzzConfig(page_size=ps, device_pages=device_pages, host_pages=host_pages,
                         write_policy=rng.choice(("write_through", "write_through_selective", "write_back")),
                         eviction_policy=rng.choice(("lru", "lru", "lfu", "priority")),
                         host_layout=rng.choice(("layer_first", "page_first")),
                         copy_faults=host_pages > 0 and rng.random() < 0.25, fault_seed=rng.randrange(1 << 30),
                         impatient=host_pages > 0 and rng.random() < 0.2,
                         state_slots=rng.choice((3, 5, 8, 8, 8)), host_state_slots=rng.choice((2, 4, 8)),
                         calls=rng.randint(150, 350))
        return replace(cfg, **_hybrid_storage(host_pages, cfg.fault_seed))
    host_pages = 0 if rng.random() < 0.1 else rng.randint(max(2, device_pages // 2), 2 * device_pages)
    storage = "none" if host_pages == 0 or rng.random() < 0.5 else rng.choice(("file", "faulty"))
    if rng.random() < 0.15:
        return FuzzConfig(
            page_size=ps, device_pages=2 * device_pages, host_pages=8 * device_pages,
            write_policy=rng.choice(("write_through", "write_back")), eviction_policy=rng.choice(("lru", "lfu")),
            host_layout=rng.choice(("layer_first", "page_first")), copy_faults=True,
            impatient=rng.random() < 0.2, calls=rng.randint(150, 350), focus="loads")
    return _with_kv_format(_with_sliding(FuzzConfig(
        page_size=ps, device_pages=device_pages, host_pages=host_pages,
        write_policy=rng.choice(("write_through", "write_through_selective", "write_back")),
        eviction_policy=rng.choice(("lru", "lru", "lfu", "priority")),
        host_layout=rng.choice(("layer_first", "page_first")),
        storage=storage,
        storage_fail_rate=rng.choice((0.05, 0.2)) if storage == "faulty" else 0.0,
        storage_page_fail_rate=rng.choice((0.0, 0.1)) if storage == "faulty" else 0.0,
        storage_fault_mode=rng.choice(("raise", "miss")),
        prefetch_policy=rng.choice(("wait_complete", "wait_complete", "best_effort", "timeout")),
        decode_offload=host_pages > 0 and rng.random() < 0.2,
        offload_stride_pages=rng.choice((1, 2)),
        engine="cpu" if rng.random() < 0.2 else "fake",
        copy_faults=host_pages > 0 and rng.random() < 0.25,
        fault_seed=rng.randrange(1 << 30),
        impatient=rng.random() < 0.2,
        calls=rng.randint(150, 350),
    )))


def _with_sliding(cfg: FuzzConfig) -> FuzzConfig:
    """`cfg` as a sliding-window episode, for about `SWA_SHARE` of those without storage or decode
    offload (the runtime refuses both with sliding layers), by a side draw salted from the already
    drawn `fault_seed`: the episode's own stream draws what it drew before, and every other episode
    is unchanged. A window of a few pages, often not page-aligned; a sliding pool smaller than the
    full one, so that sliding pages are dropped all the time; a quarter of them without a host tier."""
    if cfg.storage != "none" or cfg.decode_offload:
        return cfg
    side = random.Random(f"hicache-fuzz-swa:{cfg.fault_seed}")
    if side.random() >= SWA_SHARE:
        return cfg
    ps, pages = cfg.page_size, cfg.device_pages
    return replace(
        cfg, sliding_layers=side.choice(SWA_LAYER_SETS), sliding_window=side.randint(2, {1: 8, 4: 13, 16: 49}[ps]),
        swa_pages=side.randint(max(2, 2 * pages // 3), pages),
        host_pages=0 if side.random() < 0.25 else cfg.host_pages)


def _with_kv_format(cfg: FuzzConfig) -> FuzzConfig:
    """`cfg` with 16- or 8-bit KV pools or MLA's one latent per token, for about `KV_FORMAT_SHARE` of
    the mixed episodes without sliding layers (which need "mha"), by a side draw salted from the
    already drawn `fault_seed` as `_with_sliding`'s: the episode's own stream is unchanged. The
    fingerprints are exact in every pool dtype (`runtime.fingerprint`)."""
    if cfg.sliding:
        return cfg
    side = random.Random(f"hicache-fuzz-kv-format:{cfg.fault_seed}")
    if side.random() >= KV_FORMAT_SHARE:
        return cfg
    dtype = side.choice(KV_FORMAT_DTYPES)
    return replace(cfg, kv_dtype=dtype, kv_layout="mla" if dtype == "float32" or side.random() < 0.4 else "mha")


def _hybrid_storage(host_pages: int, fault_seed: int) -> dict[str, Any]:
    """A hybrid episode's storage tier (half of those with a host tier: file or faulty file) and
    prefetch policy, drawn from its fault seed: the episode's own draws stay as they were. (Salted:
    of seed 1's four host-tier hybrid episodes in the default run, 48 and 55 get storage and 50,
    where the planted host-load bug is found, keeps none; unsalted, 50 got storage and the plant
    was found only at episode 117, past the default run's 78.)"""
    side = random.Random(fault_seed ^ 4)
    if host_pages == 0 or side.random() < 0.5:
        return {}
    storage = side.choice(("file", "faulty"))
    return dict(storage=storage, storage_fail_rate=side.choice((0.05, 0.2)) if storage == "faulty" else 0.0,
                storage_page_fail_rate=side.choice((0.0, 0.1)) if storage == "faulty" else 0.0,
                storage_fault_mode=side.choice(("raise", "miss")),
                prefetch_policy=side.choice(("wait_complete", "wait_complete", "best_effort", "timeout")))


PEER_STORAGE_KEY = "hicache-fuzz-peer-storage-key"  # (a test key: keyed page tags in half the peer episodes)


def draw_peer_config(rng: random.Random) -> FuzzConfig:
    """A peer episode's configuration: a decode runtime whose storage tier is a fake prefill peer
    (`tests.fuzz.fake_peer`; the harness announces every prompt to it before asking the runtime,
    `Driver.announce`). As a mixed episode's (a page_first host tier, as `PeerBackend` needs; no
    storage controls: a peer removes nothing), with a short `storage_timeout_s` that the peer's long
    delays run past, keyed page tags in half of them, and the peer's fault rates per fill; about a
    quarter with another KV format (`_with_kv_format`)."""
    ps = rng.choice((1, 4, 4, 16))
    device_pages = {1: rng.randint(16, 40), 4: rng.randint(6, 16), 16: rng.randint(3, 8)}[ps]
    timeout = rng.choice((0.02, 0.05))
    return _with_kv_format(FuzzConfig(
        page_size=ps, device_pages=device_pages, host_pages=rng.randint(max(2, device_pages // 2), 2 * device_pages),
        write_policy=rng.choice(("write_through", "write_through_selective", "write_back")),
        eviction_policy=rng.choice(("lru", "lru", "lfu", "priority")), host_layout="page_first", storage="peer",
        prefetch_policy=rng.choice(("wait_complete", "wait_complete", "best_effort", "timeout")),
        decode_offload=rng.random() < 0.2, offload_stride_pages=rng.choice((1, 2)),
        engine="cpu" if rng.random() < 0.2 else "fake", copy_faults=rng.random() < 0.25,
        fault_seed=rng.randrange(1 << 30), impatient=rng.random() < 0.2, calls=rng.randint(150, 350),
        storage_timeout_s=timeout, storage_key=PEER_STORAGE_KEY if rng.random() < 0.5 else None,
        peer_drop_rate=rng.choice((0.0, 0.05, 0.2)), peer_delay_rate=rng.choice((0.1, 0.3)),
        peer_size_rate=rng.choice((0.0, 0.1)), peer_tag_rate=rng.choice((0.0, 0.1)),
        peer_expected_pages=rng.choice((1 << 16, 1 << 16, 4 * device_pages))))


def peer_episode(seed: int, episode: int) -> tuple[FuzzConfig, random.Random]:
    """`fuzz(episodes=peer_episode)`: the peer episodes of a seed (a stream of their own)."""
    rng = random.Random(f"hicache-fuzz-peer:{seed}:{episode}")
    return draw_peer_config(rng), rng


def _storage_for(cfg: FuzzConfig, directory: str | None) -> Any:
    rc = cfg.runtime_config()
    if cfg.storage == "peer":
        faults = PeerFaults(drop=cfg.peer_drop_rate, delay=cfg.peer_delay_rate, size=cfg.peer_size_rate,
                            tag=cfg.peer_tag_rate, slow_s=2 * cfg.storage_timeout_s, seed=cfg.fault_seed)
        return FakePeer(rc, faults, cfg.peer_expected_pages)
    assert directory is not None
    fb = FileBackend(directory, rc.page_size * rc.bytes_per_token)
    if cfg.storage == "file":
        return fb
    return FaultyBackend(fb, FaultPlan(fail_rate=cfg.storage_fail_rate, page_fail_rate=cfg.storage_page_fail_rate,
                                       mode=cfg.storage_fault_mode, seed=cfg.fault_seed))


def _engine_factory(cfg: FuzzConfig) -> Callable[[Any], Any]:
    if cfg.engine == "fake":
        return FakeCopyEngine

    def fault(op_id: int, layer: int) -> None:
        if random.Random(f"{cfg.fault_seed}:{op_id}:{layer}").random() < 0.08:
            raise RuntimeError(f"injected copy fault (op {op_id}, layer {layer})")

    return lambda pools: CpuCopyEngine(pools, workers_per_direction=1, copy_threads=1,
                                       fault=fault if cfg.copy_faults else None)


# -- vocabulary ---------------------------------------------------------------------------------


class Vocab:
    """Shared prefixes: a few system prompts, conversations over them (each turn boundary is a
    prompt that extends the earlier turns), and unique prompts. Every plan is `D` tokens long
    (a request's prompt, then what it will generate)."""

    NAMESPACES: tuple[Hashable, ...] = (None, None, None, None, "tenant-a", ("lora", 7))

    def __init__(self, rng: random.Random, cfg: FuzzConfig) -> None:
        self.rng = rng
        self.D = cfg.device_slots
        self.unit = max(1, self.D // 12)
        # the longest prompt, as a share of the device pool ("loads": short ones, so that live
        # requests leave the tree room and cached prefixes come back instead of being recomputed;
        # hybrid, with no host tier to make room: so that cached prefixes stay to be hit)
        self.max_prompt = 0.3 if cfg.focus == "loads" or cfg.hybrid else 0.6
        self.systems = [self.rand(rng.randint(self.unit, 3 * self.unit)) for _ in range(3)]
        self.convs: list[tuple[list[int], list[int]]] = []
        for _ in range(2 if cfg.focus == "loads" else 5):
            toks = list(rng.choice(self.systems))
            bounds = [len(toks)] if rng.random() < 0.3 else []
            while len(toks) < self.D:
                toks += self.rand(rng.randint(1, 2 * self.unit))
                bounds.append(min(len(toks), self.D))
            self.convs.append((toks[: self.D], bounds))

    def rand(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def namespace(self) -> Hashable:
        return self.rng.choice(self.NAMESPACES)

    def conversation(self) -> list[int]:
        return list(self.rng.choice(self.convs)[0])

    def prompt(self) -> tuple[list[int], list[int]]:
        """(tokens, continuation): a prompt and the D - len tokens that follow it."""
        rng, D = self.rng, self.D
        r = rng.random()
        if r < 0.65:
            toks, bounds = rng.choice(self.convs)
            fit = [b for b in bounds if b <= max(1, int(self.max_prompt * D))] or [min(bounds[0], D - 1)]
            b = rng.choice(fit)
            plan = list(toks) if rng.random() < 0.8 else toks[:b] + self.rand(D - b)  # a reply of its own
        elif r < 0.85:
            system = list(rng.choice(self.systems))
            b = len(system) + rng.randint(1, 2 * self.unit)
            plan = (system + self.rand(D))[:D]
        else:
            plan = self.rand(D)
            b = rng.randint(1, max(1, D // 2))
        b = max(1, min(b, D - 1))
        return plan[:b], plan[b:D]


# -- the model ----------------------------------------------------------------------------------


def _paged(slots: np.ndarray, ps: int) -> np.ndarray | None:
    """Every slot of the pages that `slots` (positions 0..n-1) lie in; None unless `slots` is made
    of whole, aligned pages (a page is `ps` consecutive slots from a multiple of `ps`)."""
    starts = slots[::ps]
    if len(slots) == 0:
        return slots.astype(np.int64)
    if np.any(starts % ps):
        return None
    full = (starts[:, None] + np.arange(ps)).reshape(-1).astype(np.int64)
    if not np.array_equal(full[: len(slots)], slots):
        return None
    return full


def _up(n: int, ps: int) -> int:
    return -(-n // ps) * ps


def _down(n: int, ps: int) -> int:
    return n - n % ps


@dataclass
class Req:
    rid: Hashable
    gen: int
    ns: Hashable
    plan: np.ndarray  # int32, D tokens: the prompt, then what this request will generate
    hashes: np.ndarray  # prefix hash of every plan position (the fingerprint's input)
    prompt_len: int
    seq_len: int
    slots: np.ndarray  # device slot of every position of its pages (len = _up(seq_len))
    record_len: int  # the runtime's token record is plan[:record_len]
    cached: int  # its prefix held by the tree (rec.cached_len; 0 for a session turn)
    base: int  # positions [0, base) came cached (ready once `readiness` is)
    computed: int  # positions [base, computed) hold KV the harness wrote
    committed: int
    readiness: tuple[Any, ...] = ()
    session: Hashable = None
    session_kv: int = 0
    failed: bool = False
    # hybrid: its running state slot (holds the state after `computed` tokens) and the snapshots
    # it asked for that no insert took yet (position -> slot, holding the state after position)
    state_slot: int | None = None
    snaps: dict[int, int] = field(default_factory=dict)
    # the snapshot a hit through host nodes resumes from, loaded with its KV: checked and copied into
    # the running slot once its loads are ready (`ready`), as an engine waits before its forward
    state_from: int | None = None


@dataclass
class Sess:
    sid: Hashable
    ns: Hashable
    plan: np.ndarray  # the conversation its turns follow; its tokens are plan[:kv]
    hashes: np.ndarray
    kv: int = 0
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    turn: Hashable = None


Pred = tuple[tuple[type, ...], tuple[type, ...]]  # (one of these must be raised, these may be raised)
OK: Pred = ((), ())


def _summary(res: Any, exc: Any) -> str:
    if exc is not None:
        return type(exc).__name__
    if type(res) is AdmitResult:
        return f"slots {res.slots.tolist()} cached {res.cached_device}+{res.loaded_host}"
    if isinstance(res, torch.Tensor):
        return f"slots {res.tolist()}"
    if type(res) is tuple:  # a step's results
        return "(" + ", ".join(_summary(None, r) if isinstance(r, BaseException) else _summary(r, None)
                               for r in res) + ")"
    if type(res) is dict and all(type(v) is dict for v in res.values()):  # stats(): the transfer actor's
        # in-flight and queue counts move with the completion bridge's polling, whatever the fake engine
        # released; latencies with the clock
        return repr({g: {k: v for k, v in group.items() if (g, k) not in _TIMING_STATS} for g, group in res.items()})
    return repr(res)


_TIMING_STATS = {(s.group, s.key) for s in STATS if s.kind is Kind.HISTOGRAM} | {
    ("transfer", "inflight_loads"), ("transfer", "inflight_backups"), ("queues", "waiting_loads"),
    ("queues", "waiting_backups"), ("queues", "transfer_mailbox_messages"), ("storage", "health_seconds")}


def _names(types: tuple[type, ...]) -> str:
    return "/".join(t.__name__ for t in types)


# -- what the harness reads inside the tree actor -------------------------------------------------


@dataclass
class Observation:
    invariant_error: str | None
    requests: dict[Hashable, tuple]
    sessions: dict[Hashable, tuple]
    owned: dict[Hashable, tuple]  # per live request / session: its device (and host) slots in the ledger
    storage: tuple[bool, Any] = (False, None)  # (a storage tier is on, the tree actor's backend)
    states: dict[Hashable, tuple] = field(default_factory=dict)  # per live request: (running slot, pending)
    state_errors: list[str] = field(default_factory=list)  # node snapshots not holding their path's state


def _observe(core: Any, with_host: bool, backend: Any = None, state_pool: Any = None,
             host_state_pool: Any = None) -> Observation:
    try:
        check_invariants(core)
        err = None
    except Exception as exc:  # noqa: BLE001 - the checker's own crash is a finding too
        err = f"{type(exc).__name__}: {exc}"
    empty = np.zeros(0, np.int64)
    reqs, sess, owned = {}, {}, {}
    for rid, rec in core.requests.items():
        dups = np.sort(np.asarray(getattr(rec, "dups", empty)))
        reqs[rid] = (rec.generation, rec.slots.copy(), rec.seq_len, rec.committed_len, rec.cached_len,
                     rec.tokens.copy(), dups, rec.session)
        owned[("r", rid)] = (core.residency.device.owned_slots(rec.owner),
                             core.residency.host.owned_slots(rec.owner) if with_host and core.residency.host is not None else None)
    for sid, s in core.sessions.items():
        sess[sid] = (s.tokens.copy(), s.slots.copy(), s.turn)
        owned[("s", sid)] = (core.residency.device.owned_slots(s.owner),
                             core.residency.host.owned_slots(s.owner) if with_host and core.residency.host is not None else None)
    states = _group(core, "RecurrentStates")
    held = {rid: (states.running.get(rid), dict(states.pending.get(rid, {}))) for rid in core.requests} \
        if states is not None else {}
    # node snapshots are few (at most the state slots): checked after every call, not every TREE_EVERY
    return Observation(err, reqs, sess, owned, (core.storage.attached, backend), held,
                       _tree_state_errors(core, state_pool, host_state_pool) if state_pool is not None else [])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is not None and b is not None and np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass(frozen=True)
class SwaView:
    """A sliding episode's pools as the harness (the model) sees them: the full layers in
    `rt.device_pool` / `rt.host_pool`, the sliding ones in `pool` / `host_pool` (global layer
    indices `full`, `layers`: the fingerprint of a layer is that of its index in the model)."""

    pool: Any
    host_pool: Any
    full: tuple[int, ...]
    layers: tuple[int, ...]
    window: int


def _tree_kv_errors(core: Any, device_pool: Any, host_pool: Any, swa: SwaView | None = None) -> list[str]:
    """Every tree node's ready device copy and host copy holds the fingerprint of its prefix
    (invariant 6 for nodes; a node whose device copy is still loading is exempt). Sliding layers:
    a node's device pages still mapped to sliding pages hold its prefix's sliding KV there, and
    those without are a leading run of its pages; its host copy's sliding part holds it from the
    pages its host record says have it (`SlidingWindow.host_missing`) on."""
    full = swa.full if swa is not None else None
    checks: dict[str, tuple[Any, tuple[int, ...] | None, list, list]] = {
        "device": (device_pool, full, [], []), "host": (host_pool, full, [], [])}
    if swa is not None:
        checks["device sliding"] = (swa.pool, swa.layers, [], [])
        checks["host sliding"] = (swa.host_pool, swa.layers, [], [])
    sliding = _group(core, "SlidingWindow")
    smap = sliding.swa.map if swa is not None else None
    not_leading = []
    for node in core.residency.tree.nodes():
        n = node.num_tokens
        h = prefix_hashes(core.residency.tree.path_tokens(node), node.extra_key)[-n:]
        if node.device is not None and node.id not in core.copies.loading:
            checks["device"][2].append(node.device)
            checks["device"][3].append(h)
        if node.host is not None and host_pool is not None:
            checks["host"][2].append(node.host)
            checks["host"][3].append(h)
        if smap is None:
            continue
        if node.device is not None:
            present = smap[node.device] >= 0
            if present[: int(np.count_nonzero(~present))].any():
                not_leading.append(node.id)
            if node.id not in core.copies.loading:
                checks["device sliding"][2].append(smap[node.device][present])
                checks["device sliding"][3].append(h[present])
        if node.host is not None and swa.host_pool is not None:
            k = sliding.host_missing.get(node, 0) * core.page_size
            checks["host sliding"][2].append(node.host[k:])
            checks["host sliding"][3].append(h[k:])
    out = [f"tree nodes {not_leading[:8]} have device pages without sliding KV that are not a leading run of "
           "their pages"] if not_leading else []
    for tier, (pool, layers, slots, hashes) in checks.items():
        if not slots or pool is None:
            continue
        s, h = np.concatenate(slots), np.concatenate(hashes)
        bad = _bad_positions(pool, s, h, layers)
        if len(bad):
            out.append(f"{tier} slots {s[bad][:8].tolist()} of tree nodes do not hold their prefix's KV")
    return out


def _group(core: Any, kind: str) -> Any:
    """The core's pool group of rule class `kind` (None: the model has none)."""
    return next((g for g in core.residency.groups if type(g).__name__ == kind), None)


def _tree_state_errors(core: Any, pool: Any, host_pool: Any = None) -> list[str]:
    """Every node's state snapshot holds the state after that node's whole path (its last token)."""
    states = _group(core, "RecurrentStates")
    if states is None:
        return []
    tree = core.residency.tree
    bad = []
    for held, spool, tier in ((states.node_state, pool, "device"), (states.host_state, host_pool, "host")):
        for node, slot in held.items():
            if tier == "device" and node.id in core.copies.loading:  # its snapshot is still coming back
                continue
            path = tree.path_tokens(node)
            want = state_fingerprint(spool.shape, int(prefix_hashes(path, node.extra_key)[-1]))
            if not torch.equal(spool.read_slot(slot), want):
                bad.append((tier, node.id, len(path), slot))
    return [f"state snapshots (tier, node, its end, slot) {bad[:6]} do not hold the state after their node's "
            "path"] if bad else []


def _bad_positions(pool: Any, slots: np.ndarray, hashes: np.ndarray, layers: tuple[int, ...] | None = None
                   ) -> np.ndarray:
    """Positions whose KV in `pool` is not the fingerprint of their hash; `layers`: the model's
    layers the pool holds (None: all of them, 0..L-1)."""
    shape = pool.shape
    if len(slots) == 0:
        return np.zeros(0, np.int64)
    want = _fingerprint(hashes, layers if layers is not None else tuple(range(shape.num_layers)), shape)
    if shape.dtype != torch.float32:  # what the pool can hold of it (exact by construction: runtime.fingerprint)
        want = want.to(shape.dtype).to(torch.float32)
    got = pool.read_slots(torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))).to(torch.float32)
    return torch.nonzero((got != want).flatten(3).any(-1).any(0).any(0)).flatten().numpy()


def _fingerprint(hashes: np.ndarray, layers: tuple[int, ...], shape: Any) -> torch.Tensor:
    """The fingerprint KV of these of the model's layers (a layer's does not depend on the others),
    in the dtype and parts (K and V, or MLA's latent) of the pool `shape`."""
    data = fingerprint_kv(hashes, max(layers) + 1, NUM_HEADS, HEAD_DIM, shape.dtype, shape.parts)
    return data if len(layers) == len(data) else data[list(layers)]


EMPTY_PREFIX = (1 << 61) - 1  # the state before any token (prefix hashes are below 2**61 - 1)


@functools.lru_cache(maxsize=1 << 14)
def state_fingerprint(shape: StateShape, h: int) -> torch.Tensor:
    """The canonical bytes (`StatePool.read_slot`: per component, its `[L, *shape]`) of the recurrent
    state after the prefix whose hash is `h`: element i of component c of layer l holds the 16 bits
    of `h` from 16 * (i % 4) on, plus a tag of (l, c) above them (a state of another layer or
    component differs), all below 2**24: exact in float32 (the harness's components)."""
    out = []
    for ci, c in enumerate(shape.components):
        if c.dtype != torch.float32:
            raise ValueError(f"state fingerprints are float32; component {c.name} is {c.dtype}")
        lane = np.arange(c.elems, dtype=np.int64) % 4
        rows = [((h >> (16 * lane)) & 0xFFFF) + ((1 + layer * len(shape.components) + ci) << 16)
                for layer in range(shape.num_layers)]
        out.append(torch.from_numpy(np.concatenate(rows).astype(np.float32)).view(torch.uint8))
    return torch.cat(out)


# -- the driver -----------------------------------------------------------------------------------


class Driver:
    """Runs one episode against one runtime: generates (or replays) steps, keeps the model,
    checks the oracles. `steps` is the record of what ran."""

    def __init__(self, rt: CacheRuntime, cfg: FuzzConfig, rng: random.Random, storage_dir: str | None = None) -> None:
        self.rt, self.cfg, self.rng = rt, cfg, rng
        self.ps = cfg.page_size
        # the KV events since the start, and the index they rebuild (`check_events`)
        self.events = rt.kv_events(maxsize=1 << 30)
        self.event_index = PrefixIndex(shared_storage=False)
        self.D = cfg.device_slots
        self.engine = rt.engine if isinstance(rt.engine, FakeCopyEngine) else None
        self.vocab = Vocab(rng, cfg)
        self.reqs: dict[Hashable, Req] = {}
        self.sessions: dict[Hashable, Sess] = {}
        self.prepared: set[Hashable] = set()  # rids prepare() said it reads for: abort of them may succeed
        # rids of a step's cache/finish items whose loads were (or may have been) in flight when the
        # step was sent: the items are judged after it returns, when the loads may have landed
        self.loading_when_sent: set[Hashable] = set()
        self.gone: list[Hashable] = []  # rids released lately (double finish, reuse)
        self.last_decode: list[Hashable] = []  # the last decode step generated
        self.next_rid = 0
        self.next_sid = 0
        self.steps: list[Step] = []
        self.index = 0
        self.calls = 0
        self.outcomes: list[str] = []  # what every call answered (replays must answer the same)
        self.checks = 0
        self.prev: Observation | None = None
        self.with_host = not cfg.decode_offload  # offload copies give requests host pages at any time
        # storage controls: the model's view of the tier (set when a control is sent: they run in
        # call order), the backend attached or detached last, and how many controls are in flight
        self.attached = rt.storage is not None
        self.backend = rt.storage
        self.controls_pending = 0
        self.storage_dir = storage_dir
        self.extra_backends: list[Any] = []  # fresh backends the harness attached (closed at the end)
        self.identity = KVIdentity.from_config(rt.config)
        # storage content ("file" storage; fault injection makes a read miss forget a page that stays
        # on disk): the page hashes this runtime may have written since the last clear - the pages
        # the tree held when it ran and those of every plan admitted since. A storage hit or a page
        # known stored outside it is a page that a clear left behind
        self.may_store: set[bytes] | None = set() if cfg.storage == "file" else None
        self.stored_during: set[bytes] | None = None  # what `_may_store` added while a clear ran
        # pages the harness deleted from the directory behind the runtime's back (`x_evict_pages`),
        # through a handle of its own (another process, as far as the runtime can tell)
        self.evicted: set[bytes] = set()
        self.evictor: Any = None
        self._vocab_chains: list[tuple[np.ndarray, Hashable, list[bytes]]] | None = None
        self.state_pool = rt.state_pool  # hybrid: the harness is the recurrent layers, as it is the attention
        self.final_stats: dict[str, dict[str, Any]] | None = None  # stats() at the end of the teardown
        self.counters_seen: dict[tuple[str, str], int] = {}  # the last stats()'s counters (they only grow)
        self.layers = tuple(range(cfg.num_layers))
        self.swa: SwaView | None = None  # sliding: the harness writes and reads those layers through rt.swa_map
        if cfg.sliding:
            slide = rt.config.sliding_layer_set
            self.swa = SwaView(rt.swa_pool, rt.host_swa_pool, tuple(i for i in self.layers if i not in slide), slide,
                               cfg.sliding_window)

    # -- running ---------------------------------------------------------------------------------
    async def run(self, steps: list[Step] | None) -> None:
        self.prev = await self._inspect_observation()
        if steps is None:
            while self.calls < self.cfg.calls:
                step = self.generate()
                self.steps.append(step)
                await self.execute(step)
                self.index += 1
        else:
            for step in steps:
                self.steps.append(step)
                await self.execute(step)
                self.index += 1

    async def execute(self, step: Step) -> None:
        name, args = step
        await getattr(self, f"x_{name}")(**args)

    async def inspect(self, fn: Callable[[Any], Any]) -> Any:
        """`rt.inspect`, a failed runtime being a violation (the harness's own reads never fail it)."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await self.rt.inspect(fn)
        except TimeoutError:
            raise self.fail("hang", "the tree actor did not answer an inspect") from None
        except Exception as exc:  # noqa: BLE001
            raise self.fail("runtime-failed", f"{exc!r} (cause {self.rt._sup.failure!r})") from exc

    def announce(self, toks: np.ndarray, ns: Hashable) -> None:
        """A prompt the runtime is about to be asked for (admit, prepare), told first to a prefill
        peer (`PeerBackend.expect`, storage "peer"): a lookup finds its pages there."""
        expect = getattr(self.backend, "expect", None)
        if expect is not None:
            expect(toks, ns)

    def fail(self, kind: str, detail: str) -> Violation:
        return Violation(kind, detail, self.index)

    async def call(self, what: str, make: Callable[[], Awaitable[Any]], cancel: int | None = None) -> tuple[Any, Any]:
        """Run one API call: (result, None), (None, a CallerError) or (None, CANCELLED). Anything
        else (RuntimeFailed, RuntimeClosed, a hang, a stray exception) is a violation."""
        self.calls += 1
        res, exc = await self._call(what, make, cancel)
        self.outcomes.append(f"{what} -> {_summary(res, exc)}")
        return res, exc

    async def _call(self, what: str, make: Callable[[], Awaitable[Any]], cancel: int | None) -> tuple[Any, Any]:
        try:
            if cancel is None:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    return await make(), None
            task = asyncio.ensure_future(make())
            for _ in range(cancel):
                await asyncio.sleep(0)
            task.cancel()
            try:
                return await task, None
            except asyncio.CancelledError:
                # the admission (if the message went) is released by the runtime; two round trips
                # let the actor handle the message, then the release it posts
                await self.inspect(lambda core: None)
                await self.inspect(lambda core: None)
                return None, CANCELLED
        except CallerError as exc:
            return None, exc
        except Violation:
            raise
        except TimeoutError:
            raise self.fail("hang", f"{what} did not answer in {CALL_TIMEOUT_S} s") from None
        except Exception as exc:  # noqa: BLE001
            raise self.fail("runtime-failed" if self.rt.failed else "unexpected-error",
                            f"{what} raised {exc!r} (cause {getattr(exc, '__cause__', None)!r})") from exc

    def outcome(self, what: str, pred: Pred, exc: Any) -> bool:
        """Whether the call took effect, checked against the prediction."""
        must, may = pred
        if exc is None:
            if must:
                raise self.fail("accepted-invalid", f"{what} succeeded; expected {_names(must)}")
            return True
        if must:
            if isinstance(exc, must):
                return False
            raise self.fail("wrong-error", f"{what} raised {exc!r}; expected {_names(must)}")
        if isinstance(exc, may):
            return False
        raise self.fail("refused-valid", f"{what} raised {exc!r} for a call the model holds valid")

    # -- predictions (from the model only) ---------------------------------------------------------
    def p_admit(self, rid: Hashable, toks: np.ndarray, session: Hashable) -> Pred:
        if self._facade_refuses(toks):
            return (LengthError,), ()
        must: list[type] = []
        if rid in self.reqs:
            must.append(DuplicateRequestError)
        if session is not None:
            s = self.sessions.get(session)
            if s is None:
                must.append(UnknownRequestError)
            elif s.turn is not None or len(toks) <= s.kv or not np.array_equal(toks[: s.kv], s.plan[: s.kv]):
                must.append(StateError)
        return tuple(must), (CapacityError,)

    def p_extend(self, rid: Hashable, n: int) -> Pred:
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        if n <= 0 or r.seq_len + n > self.D:
            return (LengthError,), ()
        return (), (CapacityError,)

    def p_commit(self, rid: Hashable, c: int) -> Pred:
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        if not r.committed <= c <= r.seq_len:
            return (LengthError,), ()
        return OK

    def _kv_tokens_errors(self, r: Req, toks: np.ndarray) -> list[type]:
        must: list[type] = []
        if len(toks) == 0 or len(toks) > r.seq_len:
            must.append(LengthError)
        k = min(len(toks), r.record_len)
        if not np.array_equal(toks[:k], r.plan[:k]):
            must.append(StateError)
        return must

    def _load_doubt(self, r: Req) -> tuple[bool, bool]:
        """(its load failed, it may have failed): a failed load makes cache/finish a TransferError."""
        failed = r.failed or any(x.error() is not None for x in r.readiness)
        loading_then = bool(r.readiness) and r.rid in self.loading_when_sent
        return failed, failed or loading_then or not all(x.done() for x in r.readiness)

    def _facade_refuses(self, toks: np.ndarray) -> bool:
        """The façade refuses empty or longer-than-the-pool tokens before anything is sent."""
        return len(toks) == 0 or len(toks) > self.D

    def p_cache(self, rid: Hashable, toks: np.ndarray) -> Pred:
        if self._facade_refuses(toks):
            return (LengthError,), ()
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        if r.session is not None:
            return (StateError,), ()
        failed, doubt = self._load_doubt(r)
        if failed:
            return (TransferError,), ()
        must = self._kv_tokens_errors(r, toks)
        # a load still in flight: the runtime refuses (StateError) until it is done, or it failed
        return (tuple(must) + ((TransferError,) if doubt and must else ())), ((TransferError, StateError) if doubt else ())

    def p_finish(self, rid: Hashable, toks: np.ndarray, fl: int | None) -> Pred:
        if self._facade_refuses(toks):
            return (LengthError,), ()
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        failed, doubt = self._load_doubt(r)
        if failed:
            return (TransferError,), ()
        must = self._kv_tokens_errors(r, toks)
        if fl is not None and not r.prompt_len <= r.prompt_len + fl <= len(toks):
            must.append(LengthError)
        may: tuple[type, ...] = (TransferError, StateError) if doubt else ()
        if r.session is not None and len(toks) < r.session_kv:
            # a turn that keeps less than its session had: refusing it is as good as trimming
            may += (LengthError, StateError)
        return (tuple(must) + ((TransferError,) if doubt and must else ())), may

    def p_rewind(self, rid: Hashable, n: int) -> Pred:
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        floor = r.session_kv if r.session is not None else r.cached
        if not floor <= n <= r.seq_len:
            return (LengthError,), ()
        if self.swa is not None and n < r.committed:  # it would recompute from n, reading [n - W + 1, n)
            window = self.rt.swa_map.numpy()[r.slots[max(0, n - self.swa.window + 1): n]]
            if (window < 0).any():  # a page its decode gave back
                return (LengthError,), ()
        # decode offload refuses a rewind that would cut an offload in flight
        return (), ((StateError,) if self.cfg.decode_offload else ())

    def p_snapshot(self, rid: Hashable, position: Any) -> Pred:
        if type(position) is not int:  # the façade's check, before anything is sent
            return (LengthError,), ()
        if not self.cfg.hybrid:
            return (StateError,), ()
        r = self.reqs.get(rid)
        if r is None:
            return (UnknownRequestError,), ()
        if position % self.ps or not r.cached < position <= r.seq_len:
            return (LengthError,), ()
        if position in r.snaps:
            return (StateError,), ()
        # (no state slot free nor evictable: the model does not follow the tree's snapshots)
        return (), (CapacityError,)

    def p_abort(self, rid: Hashable) -> Pred:
        if rid in self.reqs:
            return OK
        if rid in self.prepared:
            return (), (UnknownRequestError,)
        return (UnknownRequestError,), ()

    # -- model updates -------------------------------------------------------------------------------
    def _hashes(self, plan: np.ndarray, ns: Hashable) -> np.ndarray:
        return prefix_hashes(plan, ns)

    def _check_not_shared(self, rid: Hashable, own: np.ndarray, cached: np.ndarray) -> None:
        """A request's own new slots belong to no other holder; its cached slots to no other's own part."""
        for other in self.reqs.values():
            if other.rid == rid:
                continue
            other_own = other.slots[_up(other.session_kv, self.ps) if other.session is not None else other.cached:]
            # a request whose load failed maps nothing valid below its own part (rolled back, freed)
            failed = other.failed or any(x.error() is not None for x in other.readiness)
            hit = np.intersect1d(own, other_own if failed else other.slots)
            if len(hit) == 0:
                hit = np.intersect1d(cached, other_own)
            if len(hit):
                raise self.fail("slot-shared", f"{rid!r} was given slots {hit[:8].tolist()} that {other.rid!r} holds")
        for s in self.sessions.values():
            if s.turn == rid:
                continue
            hit = np.intersect1d(np.concatenate((own, cached)), s.slots)
            if len(hit):
                raise self.fail("slot-shared", f"{rid!r} was given slots {hit[:8].tolist()} of session {s.sid!r}")

    def apply_admit(self, rid: Hashable, toks: np.ndarray, cont: np.ndarray, ns: Hashable, session: Hashable,
                    res: Any) -> None:
        ps = self.ps
        if type(res) is not AdmitResult or res.rid != rid or len(res.slots) != len(toks):
            raise self.fail("admit-result", f"admit of {rid!r} ({len(toks)} tokens) returned {res!r}")
        full = _paged(res.slots.numpy().astype(np.int64), ps)
        if full is None:
            raise self.fail("admit-result", f"admit of {rid!r}: slots {res.slots.tolist()[:16]} are not whole pages")
        plan = np.concatenate((toks, cont)).astype(np.int32)
        if session is not None:
            s = self.sessions[session]
            n = len(s.slots)  # whole pages: the turn's slots start with all of the session's
            if res.cached_device != s.kv or res.loaded_host or not np.array_equal(full[:n], s.slots[:n]):
                raise self.fail("admit-result", f"turn {rid!r} of {session!r}: cached {res.cached_device} (kv {s.kv}), "
                                f"slots {full[:n].tolist()[:8]} vs the session's {s.slots[:n].tolist()[:8]}")
            own_from = len(s.slots)
            r = Req(rid, res.generation, s.ns, plan, self._hashes(plan, s.ns), len(toks), len(toks), full, len(toks),
                    0, s.kv, s.kv, s.kv, (), session, s.kv)
            s.turn = rid
        else:
            cached = res.cached
            if cached % ps or res.cached_device % ps or not 0 <= cached <= len(toks) - 1:
                raise self.fail("admit-result", f"admit of {rid!r} ({len(toks)} tokens): cached {res.cached_device} + "
                                f"{res.loaded_host} is not whole pages short of the last token")
            own_from = cached
            r = Req(rid, res.generation, ns, plan, self._hashes(plan, ns), len(toks), len(toks), full, len(toks),
                    cached, cached, cached, cached, tuple(res.readiness))
            if self.cfg.hybrid:
                self._admit_state(r, res)
            if self.swa is not None:
                self._check_cut(r)
        self._check_not_shared(rid, full[own_from:], full[:own_from])
        self._check_storage_hit(f"admit of {rid!r}", toks, r.ns, res.loaded_storage)
        self.reqs[rid] = r
        self._may_store(plan, r.ns)
        self.prepared.discard(rid)

    def _check_cut(self, r: Req) -> None:
        """A hit ends where the sliding KV of its window is present: every page of
        [cached - W + 1, cached) maps to a sliding slot (the cut), on device or loading."""
        assert self.swa is not None
        lo = max(0, r.cached - self.swa.window + 1)
        mapped = self.rt.swa_map.numpy()[r.slots[lo: r.cached]]
        if (mapped < 0).any():
            at = lo + int(np.flatnonzero(mapped < 0)[0])
            raise self.fail("swa-cut", f"admit of {r.rid!r}: a hit of {r.cached} tokens (window {self.swa.window}) "
                            f"whose window's position {at} has no sliding KV: the match was not cut back")

    def _admit_state(self, r: Req, res: AdmitResult) -> None:
        """The engine's part of a hybrid admit: a hit resumes from the snapshot `state_from`, which
        must hold the state after exactly the cached prefix (KV and state of one prefix); it is copied
        into the request's running slot. No hit: the running slot starts at the empty state."""
        slot, src, what = res.state_slot, res.state_from, f"admit of {r.rid!r}"
        if type(slot) is not int or not 0 <= slot < self.cfg.state_slots:
            raise self.fail("admit-result", f"{what}: running state slot {slot!r}")
        self._check_state_slot_free(r.rid, slot)
        if (src is None) != (res.cached == 0):
            raise self.fail("state-hit", f"{what}: {res.cached} tokens cached, resuming from state slot {src!r} "
                            "(KV without the state after it, or a state without KV)")
        r.state_slot = slot
        if src is None:
            self._write_state(slot, EMPTY_PREFIX)
        elif src == slot:
            raise self.fail("state-content", f"{what}: resumes from its own running state slot {slot}")
        elif res.readiness:  # the snapshot (or the KV) is still loading: resumed in `ready`
            r.state_from = src
        else:
            self._resume(r, src, what)

    def _resume(self, r: Req, src: int, what: str) -> None:
        if not self._holds_state(src, self._state_hash(r, r.base)):
            raise self.fail("state-content", f"{what}: resumes from state slot {src} (running slot {r.state_slot}), "
                            f"which does not hold the state after its {r.base} cached tokens")
        self.state_pool.copy_slot(src, r.state_slot)
        r.state_from = None

    def apply_snapshot(self, r: Req, position: int, slot: Any) -> None:
        """The engine copies the state after `position` tokens into the slot (written now: those
        tokens are the plan's, and stay so while the snapshot is the request's)."""
        if type(slot) is not int or not 0 <= slot < self.cfg.state_slots:
            raise self.fail("snapshot-result", f"snapshot({r.rid!r}, {position}) returned {slot!r}")
        self._check_state_slot_free(r.rid, slot)
        self._write_state(slot, self._state_hash(r, position))
        r.snaps[position] = slot

    def _check_state_slot_free(self, rid: Hashable, slot: int) -> None:
        """A state slot just handed to `rid` is no live request's running slot nor pending snapshot."""
        for other in self.reqs.values():
            if slot == other.state_slot or slot in other.snaps.values():
                raise self.fail("slot-shared", f"{rid!r} was given state slot {slot}, which {other.rid!r} holds")

    def _state_hash(self, r: Req, n: int) -> int:
        return int(r.hashes[n - 1]) if n else EMPTY_PREFIX

    def _write_state(self, slot: int, h: int) -> None:
        self.state_pool.write_slot(slot, state_fingerprint(self.state_pool.shape, h))

    def _holds_state(self, slot: int, h: int) -> bool:
        return torch.equal(self.state_pool.read_slot(slot), state_fingerprint(self.state_pool.shape, h))

    def _snapshots_kept(self, r: Req) -> None:
        """An insert reached `r.cached`: the snapshots up to it passed to the tree."""
        r.snaps = {p: s for p, s in r.snaps.items() if p > r.cached}

    def release(self, rid: Hashable) -> None:
        r = self.reqs.pop(rid)
        if r.session is not None:
            self.sessions[r.session].turn = None
        self.gone = (self.gone + [rid])[-8:]

    def _storage_pages(self, tokens: np.ndarray, ns: Hashable) -> list[bytes]:
        return page_hashes(np.asarray(tokens), self.ps, ns, self.identity)

    def _may_store(self, plan: np.ndarray, ns: Hashable) -> None:
        """A plan admitted: its pages may be written to storage from now on (into the tree and out)."""
        if self.may_store is not None:
            pages = self._storage_pages(plan, ns)
            self.may_store.update(pages)
            if self.stored_during is not None:
                self.stored_during.update(pages)

    def _check_storage_hit(self, what: str, toks: np.ndarray, ns: Hashable, loaded: int) -> None:
        """`loaded` tokens of an admit came from storage: none with no tier (nor a control in flight);
        with "file" storage, a run of that many pages of the prompt that this runtime may have
        written since the last clear (the prefetch read them as one run)."""
        if not loaded:
            return
        if not self.attached and not self.controls_pending:
            raise self.fail("storage-detached", f"{what}: {loaded} tokens loaded from storage with no storage tier")
        if self.may_store is None:
            return
        run = best = 0
        for h in self._storage_pages(toks, ns):
            run = run + 1 if h in self.may_store else 0
            best = max(best, run)
        if best * self.ps < loaded:
            raise self.fail("storage-content", f"{what}: {loaded} tokens loaded from storage, but at most {best * self.ps} "
                            "of its prompt run over pages this runtime may have written since the last clear_storage")

    async def ready(self, r: Req) -> None:
        """A patient caller's wait for the request's loads before it computes: on the fake engine the
        harness completes those copies (as time would), then waits for their readiness. A hit through
        host nodes resumes its state from the snapshot that came with them, once they are ready."""
        if self.cfg.impatient or all(x.done() for x in r.readiness):
            if r.state_from is not None and all(x.done() and x.error() is None for x in r.readiness):
                self._resume(r, r.state_from, f"the loads of {r.rid!r}")
            return
        if self.engine is not None:
            pending = set(self.engine.pending())
            for x in r.readiness:
                if x.op_id in pending:
                    try:
                        self.engine.release(x.op_id)
                    except StateError:
                        pass
            await self.wait_acks()
        for x in r.readiness:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await x.wait_all()
            except TransferError:
                r.failed = True
            except TimeoutError:
                raise self.fail("hang", f"the loads of {r.rid!r} never completed") from None
        if r.state_from is not None and not r.failed:
            self._resume(r, r.state_from, f"the loads of {r.rid!r}")

    async def compute(self, r: Req, upto: int) -> None:
        """The model step: write the fingerprint KV of positions [computed, upto) into their slots."""
        upto = min(upto, r.seq_len)
        if upto <= r.computed:
            return
        await self.ready(r)
        r.state_from = None  # (an impatient caller computes before its state came back: no resume to check)
        a = r.computed
        data = _fingerprint(r.hashes[a:upto], self.layers, self.rt.device_pool.shape)
        if self.swa is None:
            self.rt.device_pool.write_slots(torch.from_numpy(r.slots[a:upto].copy()), data)
        else:
            self._swa_forward(r, a, upto, data)
        r.computed = upto
        if r.state_slot is not None:  # the recurrent layers ran over the same tokens
            self._write_state(r.state_slot, self._state_hash(r, upto))

    def _swa_forward(self, r: Req, a: int, upto: int, data: torch.Tensor) -> None:
        """The model step of a sliding episode: positions [a, upto) read the sliding KV of
        [a - W + 1, a) through the map (present, and their own prefix's once loaded) and write
        their full layers at their slots, their sliding layers at the sliding slots mapped."""
        swa = self.swa
        assert swa is not None
        lo = max(0, a - swa.window + 1)
        smap = self.rt.swa_map.numpy()
        if not (r.failed or any(x.error() is not None for x in r.readiness)):
            mapped = smap[r.slots[lo:upto]]
            if (mapped < 0).any():
                at = lo + int(np.flatnonzero(mapped < 0)[0])
                raise self.fail("swa-window", f"the forward of {r.rid!r} over [{a}, {upto}) reads position {at} "
                                f"(window {swa.window}, cached {r.cached}), whose sliding KV was dropped")
            start = lo if all(x.all_ready() for x in r.readiness) else max(lo, r.base)
            bad = _bad_positions(swa.pool, mapped[start - lo: a - lo], r.hashes[start:a], swa.layers)
            if len(bad):
                raise self.fail("swa-content", f"the forward of {r.rid!r} over [{a}, {upto}) reads positions "
                                f"{(start + bad[:8]).tolist()} whose sliding KV is not its own prefix's")
        own = smap[r.slots[a:upto]]
        if (own < 0).any():
            raise self.fail("swa-window", f"{r.rid!r}'s own positions {(a + np.flatnonzero(own < 0)[:8]).tolist()} "
                            "have no sliding slot")
        self.rt.device_pool.write_slots(torch.from_numpy(r.slots[a:upto].copy()), data[list(swa.full)])
        swa.pool.write_slots(torch.from_numpy(own.copy()), data[list(swa.layers)])

    def tokens_of(self, rid: Hashable, m: int, flip: int | None, given: list[int] | None) -> np.ndarray:
        r = self.reqs.get(rid)
        if given is not None or r is None:
            return np.asarray(given if given is not None else [1] * max(m, 0), dtype=np.int32)
        toks = r.plan[:m].copy()
        if flip is not None and flip < len(toks):
            toks[flip] = (toks[flip] + 1) % VOCAB
        return toks

    # -- oracles after every call -----------------------------------------------------------------------
    async def _inspect_observation(self) -> Observation:
        with_host, tree = self.with_host, self.rt._tree
        spool, hspool = self.state_pool, self.rt.host_state_pool
        return await self.inspect(lambda core: _observe(core, with_host, tree.backend, spool, hspool))

    async def loading(self) -> bool:
        """Whether a load is in flight (then an insert may stop at its nodes); on the CPU engine a
        load may also start in the call itself, so there it is always a maybe."""
        return self.engine is None or bool(await self.inspect(lambda core: bool(core.copies.loading)))

    async def check(self, what: str, exc: Any) -> None:
        if self.rt.failed:
            raise self.fail("runtime-failed", f"after {what}: {self.rt._sup.failure!r}")
        obs = await self._inspect_observation()
        if obs.invariant_error is not None:
            raise self.fail("invariant", f"after {what}: {obs.invariant_error}")
        if obs.state_errors:
            raise self.fail("tree-state-content", f"after {what}: " + "; ".join(obs.state_errors))
        if isinstance(exc, ValidationError) and self.prev is not None:
            self._unchanged(what, exc, self.prev, obs)
        self.prev = obs
        self._compare(what, obs)
        self._check_kv(what)
        if self.cfg.hybrid:
            self._check_states(what)
        self.checks += 1
        if self.checks % TREE_EVERY == 0:
            await self.check_tree(what)

    def _unchanged(self, what: str, exc: Any, before: Observation, after: Observation) -> None:
        for name in ("requests", "sessions", "owned", "states"):
            a, b = getattr(before, name), getattr(after, name)
            if set(a) != set(b):
                raise self.fail("validation-changed-state", f"{what} raised {exc!r} but live {name} went "
                                f"from {sorted(map(repr, a))} to {sorted(map(repr, b))}")
            for key in a:
                if not _same(a[key], b[key]):
                    raise self.fail("validation-changed-state", f"{what} raised {exc!r} but {name[:-1]} {key!r} "
                                    f"changed: {a[key]!r} -> {b[key]!r}")
        if not self.controls_pending and before.storage != after.storage:
            raise self.fail("validation-changed-state", f"{what} raised {exc!r} but the storage tier went from "
                            f"{before.storage!r} to {after.storage!r}")

    def _compare(self, what: str, obs: Observation) -> None:
        if not self.controls_pending and obs.storage != (self.attached, self.backend if self.attached else None):
            raise self.fail("storage-control", f"after {what}: storage tier (on, backend) is {obs.storage!r}; the "
                            f"controls called make it ({self.attached}, {self.backend if self.attached else None!r})")
        if set(obs.requests) != set(self.reqs):
            extra = sorted(map(repr, set(obs.requests) - set(self.reqs)))
            missing = sorted(map(repr, set(self.reqs) - set(obs.requests)))
            raise self.fail("live-set", f"after {what}: live in the runtime but not given to the caller: {extra}; "
                            f"live for the caller but gone from the runtime: {missing}")
        for rid, r in self.reqs.items():
            gen, slots, seq_len, committed, cached, tokens, _dups, session = obs.requests[rid]
            problems = []
            if gen != r.gen:
                problems.append(f"generation {gen} != {r.gen}")
            if not np.array_equal(slots, r.slots):
                diff = np.flatnonzero(slots[: len(r.slots)] != r.slots[: len(slots)])[:4].tolist() \
                    if len(slots) and len(r.slots) else []
                problems.append(f"slots changed under the caller (positions {diff}, {len(slots)} vs {len(r.slots)} slots: "
                                f"runtime {slots.tolist()[:16]} caller {r.slots.tolist()[:16]})")
            if seq_len != r.seq_len:
                problems.append(f"seq_len {seq_len} != {r.seq_len}")
            if committed != r.committed:
                problems.append(f"committed {committed} != {r.committed}")
            if cached != r.cached:
                problems.append(f"cached {cached} != {r.cached}")
            if not np.array_equal(tokens, r.plan[: r.record_len]):
                problems.append(f"token record has {len(tokens)} tokens, the caller gave {r.record_len}"
                                f"{'' if len(tokens) != r.record_len else ' (different ones)'}")
            if session != r.session:
                problems.append(f"session {session!r} != {r.session!r}")
            if problems:
                kind = "slots-changed" if any(p.startswith("slots") for p in problems) else \
                    "token-record" if any(p.startswith("token") for p in problems) else "request-record"
                raise self.fail(kind, f"after {what}: request {rid!r}: " + "; ".join(problems))
            if self.cfg.hybrid and obs.states.get(rid) != (r.state_slot, r.snaps):
                raise self.fail("state-record", f"after {what}: request {rid!r}: (running state slot, pending snapshots) "
                                f"{obs.states.get(rid)!r}, the caller holds {(r.state_slot, r.snaps)!r}")
        if set(obs.sessions) != set(self.sessions):
            raise self.fail("session-set", f"after {what}: sessions {sorted(map(repr, obs.sessions))} != "
                            f"{sorted(map(repr, self.sessions))}")
        for sid, s in self.sessions.items():
            tokens, slots, turn = obs.sessions[sid]
            if not np.array_equal(tokens, s.plan[: s.kv]) or not np.array_equal(slots, s.slots) or turn != s.turn:
                raise self.fail("session-record", f"after {what}: session {sid!r}: tokens {len(tokens)} (model {s.kv}), "
                                f"slots {slots.tolist()[:12]} (model {s.slots.tolist()[:12]}), turn {turn!r} ({s.turn!r})")

    def _check_kv(self, what: str) -> None:
        slots, hashes, owners = [], [], []
        for r in self.reqs.values():
            if r.failed or any(x.error() is not None for x in r.readiness):
                r.failed = True
                continue
            start = 0 if all(x.all_ready() for x in r.readiness) else r.base
            if r.computed > start:
                slots.append(r.slots[start: r.computed])
                hashes.append(r.hashes[start: r.computed])
                owners += [(r.rid, p) for p in range(start, r.computed)]
        for s in self.sessions.values():
            if s.turn is None and s.kv:
                slots.append(s.slots[: s.kv])
                hashes.append(s.hashes[: s.kv])
                owners += [(f"session {s.sid!r}", p) for p in range(s.kv)]
        if self.swa is not None:
            self._check_swa(what)
        if not slots:
            return
        bad = _bad_positions(self.rt.device_pool, np.concatenate(slots), np.concatenate(hashes),
                             self.swa.full if self.swa is not None else None)
        if len(bad):
            who = [owners[i] for i in bad[:6]]
            raise self.fail("kv-content", f"after {what}: positions (holder, position) {who} do not hold the KV of "
                            "their own token prefix")

    def _check_swa(self, what: str) -> None:
        """Sliding layers: every live request's pages from its window's start (`committed - W + 1`,
        where its next forward reads from) on map to sliding slots, and from there to what it
        computed they hold its own prefix's sliding KV (the cached part once its loads are ready);
        every idle session's, all of them."""
        swa = self.swa
        assert swa is not None
        smap = self.rt.swa_map.numpy()
        slots, hashes, owners = [], [], []
        for r in self.reqs.values():
            if r.failed:  # (`_check_kv` marked those whose load failed)
                continue
            lo = max(0, r.committed - swa.window + 1)
            mapped = smap[r.slots[lo:]]
            if (mapped < 0).any():
                at = lo + int(np.flatnonzero(mapped < 0)[0])
                raise self.fail("swa-window", f"after {what}: request {r.rid!r} (committed {r.committed}, window "
                                f"{swa.window}) maps position {at}, which its window reads, to a dropped sliding slot")
            start = lo if all(x.all_ready() for x in r.readiness) else max(lo, r.base)
            if r.computed > start:
                slots.append(mapped[start - lo: r.computed - lo])
                hashes.append(r.hashes[start: r.computed])
                owners += [(r.rid, p) for p in range(start, r.computed)]
        for sess in self.sessions.values():
            if sess.turn is None and sess.kv:
                mapped = smap[sess.slots[: sess.kv]]
                if (mapped < 0).any():
                    raise self.fail("swa-window", f"after {what}: session {sess.sid!r} maps positions "
                                    f"{np.flatnonzero(mapped < 0)[:8].tolist()} to dropped sliding slots")
                slots.append(mapped)
                hashes.append(sess.hashes[: sess.kv])
                owners += [(f"session {sess.sid!r}", p) for p in range(sess.kv)]
        if not slots:
            return
        bad = _bad_positions(swa.pool, np.concatenate(slots), np.concatenate(hashes), swa.layers)
        if len(bad):
            who = [owners[i] for i in bad[:6]]
            raise self.fail("swa-content", f"after {what}: positions (holder, position) {who} do not hold the sliding "
                            "KV of their own token prefix")

    def _check_states(self, what: str) -> None:
        """Every live request's running slot holds the state after its computed tokens; each of its
        pending snapshots the state after its position."""
        bad = []
        for r in self.reqs.values():
            if r.state_from is not None:  # resumes once its loads are ready (an impatient caller: never)
                continue
            if r.state_slot is not None and not self._holds_state(r.state_slot, self._state_hash(r, r.computed)):
                bad.append((r.rid, f"running after {r.computed}", r.state_slot))
            bad += [(r.rid, p, s) for p, s in r.snaps.items() if not self._holds_state(s, self._state_hash(r, p))]
        if bad:
            raise self.fail("state-content", f"after {what}: state slots (holder, position, slot) {bad[:6]} do not hold "
                            "the state after their own token prefix")

    async def check_tree(self, what: str) -> None:
        # (the tree's state snapshots are checked after every call, by the observation)
        dev, host, swa = self.rt.device_pool, self.rt.host_pool, self.swa
        errors = await self.inspect(lambda core: _tree_kv_errors(core, dev, host, swa))
        if errors:
            raise self.fail("tree-kv-content", f"after {what}: " + "; ".join(errors))
        await self.check_events(what)
        await self.check_directory(what)

    async def check_events(self, what: str) -> None:
        """The index rebuilt from the KV events alone holds exactly the pages each tier holds (by
        page hash, computed here from the tree's paths) and the pages storage is known to hold."""
        # both read inside one tree-actor turn: the batches of exactly the turns before it
        detached = self.rt._tree.detached_known
        backend = self.backend
        truth, batches = await self.inspect(lambda core: (_resident_pages(core, _kept(detached, backend)),
                                                          self.events.take_ready()))
        for batch in batches:
            self.event_index.apply("rt", batch)
        if self.may_store is not None and truth[2] - self.may_store:
            raise self.fail("storage-content", f"after {what}: storage is known to hold {len(truth[2] - self.may_store)} "
                            "pages this runtime cannot have written since the last clear_storage")
        for medium, pages in zip((GPU, CPU, STORAGE), truth):
            got = self.event_index.pages("rt", medium)
            if got != pages:
                raise self.fail("kv-events", f"after {what}: the events say {len(got)} {medium} pages, the runtime "
                                f"holds {len(pages)}: {len(got - pages)} announced but not held, {len(pages - got)} "
                                "held but not announced")

    async def check_directory(self, what: str) -> None:
        """File storage, in one tree-actor turn (no clear removing): every page file in the directory
        is one the tier (or the record kept for the backend detached last) knows stored, holds in
        doubt, or is writing - a page outside them is one a clear would leave behind; and every page
        known stored is in the directory unless the harness deleted it (`x_evict_pages`)."""
        if self.may_store is None or self.storage_dir is None:
            return
        tree, backend, directory = self.rt._tree, self.backend, self.storage_dir

        def read(core: Any) -> tuple[set[bytes], set[bytes], set[bytes], set[bytes]] | None:
            if tree._removing:
                return None
            st = core.storage
            rec = (StoredPages(st.known, st.doubtful, states=st.known_states) if st.attached
                   else _kept_record(tree.detached_known, backend))
            # (a hybrid model's state snapshots are chunk files too: known, in doubt or being written)
            writing = ({k for op in st.ops.values() if op.write for k in (*op.keys, *(k for b in op.states for k in b.keys))}
                       if st.attached else set())
            known, doubtful = ((set(rec.known) | {k for keys in rec.states.values() for k in keys}, set(rec.doubtful))
                               if rec is not None else (set(), set()))
            return _page_files(directory), known, doubtful, writing

        seen = await self.inspect(read)
        if seen is None:
            return
        files, known, doubtful, writing = seen
        stray = files - known - doubtful - writing
        if stray:
            raise self.fail("storage-content", f"after {what}: {len(stray)} page files in the storage directory that the "
                            "runtime neither knows stored nor holds in doubt nor is writing (a clear_storage leaves them)")
        lost = known - files - self.evicted
        if lost:
            raise self.fail("storage-content", f"after {what}: {len(lost)} pages known stored are not in the storage "
                            "directory, and nobody deleted them behind the runtime's back")

    # -- copies ---------------------------------------------------------------------------------------
    async def wait_acks(self, timeout: float = 10.0) -> None:
        """Until every completed copy whose ack may go has been applied. Acks go in issue order per
        direction, so a completed copy behind a pending one of its direction waits (by design)."""
        assert self.engine is not None
        pending = set(self.engine.pending())
        blocked: set[Any] = set()
        due: list[int] = []
        for plan in self.engine.submitted:
            if plan.op_id in pending:
                blocked.add(plan.direction)
            elif plan.direction not in blocked:
                due.append(plan.op_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            late = await self.inspect(lambda core: [op for op in due if op in core.copies.ops
                                                    or (core.offload is not None and op in core.offload.ops)])
            if not late:
                return
            if loop.time() > deadline:
                raise self.fail("ack-lost", f"copies {late[:8]} completed, none before them pending, but their "
                                "acks were never applied")
            await asyncio.sleep(0.0003)

    async def settle(self, timeout: float = 15.0) -> None:
        """Until nothing is in flight: copies (released here on the fake engine), storage ops,
        prefetches, retired decode-offload requests."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout

        def busy(core: Any) -> int:
            return core.in_flight() + len(_prefetches(core)) + len(_retired(core))

        while True:
            if self.engine is not None:
                for op in self.engine.pending():
                    try:
                        self.engine.release(op)
                    except Exception:  # noqa: BLE001 - finished by another path meanwhile
                        pass
            if self.rt.failed:
                raise self.fail("runtime-failed", f"while settling: {self.rt._sup.failure!r}")
            if not await self.inspect(busy):
                return
            if loop.time() > deadline:
                left = await self.inspect(lambda core: (list(core.copies.ops), list(_prefetches(core)),
                                                           list(_retired(core)), core.in_flight()))
                raise self.fail("never-settles", f"still in flight after {timeout} s: {left}")
            await asyncio.sleep(0.0005)

    # -- step executors (x_<name>) ------------------------------------------------------------------------
    async def x_admit(self, rid: Hashable, tokens: list[int], cont: list[int], ns: Hashable = None,
                      session: Hashable = None, cancel: int | None = None) -> None:
        toks = np.asarray(tokens, dtype=np.int32)
        pred = self.p_admit(rid, toks, session)
        what = f"admit({rid!r}, {len(toks)} tokens{', session ' + repr(session) if session is not None else ''})"
        self.announce(toks, ns)
        res, exc = await self.call(what, lambda: self.rt.admit(rid, toks, ns, session=session), cancel)
        if exc is CANCELLED:
            await self.check(what + " cancelled", None)
            return
        if self.outcome(what, pred, exc):
            self.apply_admit(rid, toks, np.asarray(cont, dtype=np.int32), ns, session, res)
        await self.check(what, exc)

    async def x_compute(self, rid: Hashable, upto: int) -> None:
        r = self.reqs.get(rid)
        if r is not None:
            await self.compute(r, upto)

    async def x_extend(self, rid: Hashable, n: int) -> None:
        await self.request_call(f"extend({rid!r}, {n})", self.p_extend(rid, n), lambda: self.rt.extend(rid, n),
                                lambda res: self.apply_extend(self.reqs[rid], n, res))

    async def request_call(self, what: str, pred: Pred, make: Callable[[], Awaitable[Any]],
                           apply: Callable[[Any], None]) -> None:
        """One call on a request: its answer applied to the model where the prediction allows it, then checked."""
        res, exc = await self.call(what, make)
        if self.outcome(what, pred, exc):
            apply(res)
        await self.check(what, exc)

    def apply_extend(self, r: Req, n: int, res: Any) -> None:
        got = np.asarray(res, dtype=np.int64)
        if len(got) != n:
            raise self.fail("extend-result", f"extend({r.rid!r}, {n}) returned {len(got)} slots")
        full = _paged(np.concatenate((r.slots[: r.seq_len], got)), self.ps)
        if full is None or not np.array_equal(full[: len(r.slots)], r.slots[: len(full)]):
            raise self.fail("extend-result", f"extend({r.rid!r}, {n}) returned slots {got.tolist()[:16]} that are not "
                            f"whole pages continuing its own {r.slots.tolist()[-self.ps:]}")
        new = full[len(r.slots):]
        r.seq_len += n
        r.slots = full
        self._check_not_shared(r.rid, new, np.zeros(0, np.int64))

    async def x_decode(self, rids: list[Hashable]) -> None:
        """decode_step: all or nothing; each request commits what it has and gets one slot."""
        for rid in dict.fromkeys(rids):
            r = self.reqs.get(rid)
            if r is not None:
                await self.compute(r, r.seq_len)  # the forward pass wrote the KV it commits
        known = [self.reqs.get(rid) for rid in rids]
        if any(r is None for r in known):
            pred: Pred = (UnknownRequestError,), ()
        elif len(set(rids)) != len(rids):
            pred = (ArgumentError,), ()
        elif any(r.seq_len + 1 > self.D for r in known):
            pred = (LengthError,), ()
        else:
            pred = (), (CapacityError,)
        what = f"decode_step({rids!r})"
        res, exc = await self.call(what, lambda: self.rt.decode_step(rids))
        if self.outcome(what, pred, exc):
            got = np.asarray(res, dtype=np.int64)
            if got.shape != (len(rids),):
                raise self.fail("decode-result", f"{what} returned {got.tolist()[:8]}")
            for i, rid in enumerate(rids):
                r = self.reqs[rid]
                r.committed = r.seq_len
                self.apply_extend(r, 1, got[i:i + 1])
        await self.check(what, exc)

    async def x_commit(self, rid: Hashable, c: int) -> None:
        r = self.reqs.get(rid)
        if r is not None:
            await self.compute(r, c)  # committed tokens have their KV written (decode offload copies them)
        pred = self.p_commit(rid, c)
        what = f"commit({rid!r}, {c})"
        res, exc = await self.call(what, lambda: self.rt.commit(rid, c))
        if self.outcome(what, pred, exc):
            if res != c:
                raise self.fail("commit-result", f"{what} returned {res!r}")
            self.reqs[rid].committed = c
        await self.check(what, exc)

    async def x_cache(self, rid: Hashable, m: int, flip: int | None = None, tokens: list[int] | None = None) -> None:
        toks = self.tokens_of(rid, m, flip, tokens)
        r = self.reqs.get(rid)
        if r is not None:
            await self.compute(r, len(toks))
        pred = self.p_cache(rid, toks)
        what = f"cache({rid!r}, {len(toks)} tokens{', flipped at ' + str(flip) if flip is not None else ''})"
        loading = await self.loading()
        res, exc = await self.call(what, lambda: self.rt.cache(rid, toks))
        self.apply_cache(rid, toks, pred, res, exc, what, loading)
        await self.check(what, exc)

    def apply_cache(self, rid: Hashable, toks: np.ndarray, pred: Pred, res: Any, exc: Any, what: str,
                    loading: bool = False) -> None:
        if not self.outcome(what, pred, exc):
            if isinstance(exc, TransferError) and rid in self.reqs:
                self.reqs[rid].failed = True
            return
        r = self.reqs[rid]
        m = len(toks)
        r.record_len = max(r.record_len, m)
        want = max(r.cached, _down(m, self.ps))
        if loading and type(res) is int and r.cached <= res <= want and res % self.ps == 0:
            want = res  # the insert stopped at a node still loading (docs/API.md)
        if want > r.cached:
            r.cached = want
            r.committed = max(r.committed, min(m, r.seq_len))
        if res != r.cached:
            raise self.fail("cache-result", f"{what} returned {res!r}; the prefix cached is {r.cached}")
        self._snapshots_kept(r)

    async def x_finish(self, rid: Hashable, m: int, finished_len: int | None = None, flip: int | None = None,
                       tokens: list[int] | None = None) -> None:
        toks = self.tokens_of(rid, m, flip, tokens)
        r = self.reqs.get(rid)
        if r is not None:
            await self.compute(r, len(toks))
        pred = self.p_finish(rid, toks, finished_len)
        what = f"finish({rid!r}, {len(toks)} tokens, finished_len={finished_len})"
        loading = await self.loading()
        res, exc = await self.call(what, lambda: self.rt.finish(rid, toks, finished_len))
        self.apply_finish(rid, toks, finished_len, pred, res, exc, what, loading)
        await self.check(what, exc)

    def apply_finish(self, rid: Hashable, toks: np.ndarray, fl: int | None, pred: Pred, res: Any, exc: Any,
                     what: str, loading: bool = False) -> None:
        if not self.outcome(what, pred, exc):
            if isinstance(exc, TransferError) and rid in self.reqs:
                self.release(rid)  # a finish whose load failed releases the request
            return
        r = self.reqs[rid]
        keep = len(toks) if fl is None else r.prompt_len + fl
        if r.session is not None:
            s = self.sessions[r.session]
            s.plan, s.hashes, s.kv = r.plan, r.hashes, keep
            s.slots = r.slots[: _up(keep, self.ps)].copy()
            want = keep
        elif self.cfg.decode_offload:
            want = r.cached
        else:
            want = max(r.cached, _down(keep, self.ps))
            if loading and type(res) is int and r.cached <= res <= want and res % self.ps == 0:
                want = res  # the insert stopped at a node still loading (docs/API.md)
        if res != want:
            raise self.fail("finish-result", f"{what} returned {res!r}; expected {want}")
        self.release(rid)

    async def x_abort(self, rid: Hashable) -> None:
        pred = self.p_abort(rid)
        what = f"abort({rid!r})"
        _, exc = await self.call(what, lambda: self.rt.abort(rid))
        if self.outcome(what, pred, exc) and rid in self.reqs:
            self.release(rid)
        self.prepared.discard(rid)
        await self.check(what, exc)

    async def x_rewind(self, rid: Hashable, new_len: int, redraw: list[int] | None = None) -> None:
        pred = self.p_rewind(rid, new_len)
        what = f"rewind({rid!r}, {new_len})"
        res, exc = await self.call(what, lambda: self.rt.rewind(rid, new_len))
        if self.outcome(what, pred, exc):
            if res != new_len:
                raise self.fail("rewind-result", f"{what} returned {res!r}")
            r = self.reqs[rid]
            r.seq_len = new_len
            r.slots = r.slots[: _up(new_len, self.ps)]
            r.record_len = min(r.record_len, new_len)
            r.computed = min(r.computed, new_len)
            r.committed = min(r.committed, new_len)
            r.snaps = {p: s for p, s in r.snaps.items() if p <= new_len}  # those past it are freed
            if r.state_slot is not None:  # the engine restores the state of the tokens kept
                self._write_state(r.state_slot, self._state_hash(r, r.computed))
            if redraw is not None:  # generation goes another way from here
                r.plan = np.concatenate((r.plan[:new_len], np.asarray(redraw, np.int32)))[: self.D].astype(np.int32)
                r.hashes = self._hashes(r.plan, r.ns)
                self._may_store(r.plan, r.ns)
        await self.check(what, exc)

    async def x_snapshot(self, rid: Hashable, position: Any) -> None:
        await self.request_call(f"snapshot({rid!r}, {position})", self.p_snapshot(rid, position),
                                lambda: self.rt.snapshot(rid, position),
                                lambda res: self.apply_snapshot(self.reqs[rid], position, res))

    async def x_open_session(self, sid: Hashable, plan: list[int], ns: Hashable = None) -> None:
        # (hybrid: sessions keep no recurrent state yet, and say so before anything else)
        must = (StateError,) if self.cfg.hybrid else (DuplicateRequestError,) if sid in self.sessions else ()
        what = f"open_session({sid!r})"
        _, exc = await self.call(what, lambda: self.rt.open_session(sid, ns))
        if self.outcome(what, (must, ()), exc):
            p = np.asarray(plan, np.int32)
            self.sessions[sid] = Sess(sid, ns, p, self._hashes(p, ns))
        await self.check(what, exc)

    async def x_close_session(self, sid: Hashable, insert: bool) -> None:
        s = self.sessions.get(sid)
        must = (UnknownRequestError,) if s is None else (StateError,) if s.turn is not None else ()
        what = f"close_session({sid!r}, insert={insert})"
        loading = await self.loading()
        res, exc = await self.call(what, lambda: self.rt.close_session(sid, insert=insert))
        if self.outcome(what, (must, ()), exc):
            assert s is not None
            want = _down(s.kv, self.ps) if insert else 0
            if loading and type(res) is int and 0 <= res <= want and res % self.ps == 0:
                want = res  # the insert stopped at a node still loading (docs/API.md)
            if res != want:
                raise self.fail("close-session-result", f"{what} returned {res!r}; expected {want}")
            del self.sessions[sid]
        await self.check(what, exc)

    async def x_prepare(self, rid: Hashable, tokens: list[int], ns: Hashable = None) -> None:
        toks = np.asarray(tokens, np.int32)
        what = f"prepare({rid!r}, {len(toks)} tokens)"
        self.announce(toks, ns)
        res, exc = await self.call(what, lambda: self.rt.prepare(rid, toks, ns))
        self.outcome(what, OK, exc)
        if type(res) is not int or not 0 <= res <= len(toks) or (self.cfg.storage == "none" and res):
            raise self.fail("prepare-result", f"{what} returned {res!r}")
        if res and not self.attached and not self.controls_pending:
            raise self.fail("storage-detached", f"{what} returned {res}: a lookup started with no storage tier")
        if res:
            self.prepared.add(rid)
        await self.check(what, exc)

    async def x_match_prefix(self, tokens: list[int], ns: Hashable = None, cancel: int | None = None) -> None:
        toks = np.asarray(tokens, np.int32)
        what = f"match_prefix({len(toks)} tokens)"
        res, exc = await self.call(what, lambda: self.rt.match_prefix(toks, ns), cancel)
        if exc is not CANCELLED and self.outcome(what, OK, exc):
            d, h = res.get("device"), res.get("host")
            if d % self.ps or h % self.ps or d < 0 or h < 0 or d + h > len(toks) or (self.cfg.host_pages == 0 and h):
                raise self.fail("match-result", f"{what} returned {res!r}")
        await self.check(what, None if exc is CANCELLED else exc)

    async def x_can_admit(self, tokens: list[int], ns: Hashable = None, cancel: int | None = None) -> None:
        toks = np.asarray(tokens, np.int32)
        what = f"can_admit({len(toks)} tokens)"
        res, exc = await self.call(what, lambda: self.rt.can_admit(toks, ns), cancel)
        if exc is not CANCELLED and self.outcome(what, OK, exc) and type(res) is not bool:
            raise self.fail("can-admit-result", f"{what} returned {res!r}")
        await self.check(what, None if exc is CANCELLED else exc)

    async def x_crowd(self, pressure: dict[str, Any] | None, items: list[tuple[str, dict[str, Any]]],
                      fail_first_load: bool = False) -> None:
        """`pressure`: a long unrelated prompt passes through first (admitted, then aborted): cached
        prefixes lose their device copies, those backed up stay on host. Then one batch of `items`;
        `fail_first_load`: then the oldest load in flight fails (loads started under it, by the
        batch's later admits, must be rolled back with it)."""
        if pressure is not None:
            # as long as the pool allows: every evictable device copy goes
            av, _ = await self.call("available()", self.rt.available)
            room = av["device_free"] + av["device_evictable"] if av else 0
            toks = pressure["tokens"][:room]
            if len(toks) >= 2:
                await self.x_admit(pressure["rid"], toks, pressure["cont"] + pressure["tokens"][room:])
                if pressure["rid"] in self.reqs:
                    await self.x_abort(pressure["rid"])
        await self.x_batch(items, None)
        if fail_first_load:
            await self.x_release(0, None, True, loads=True)

    async def x_can_then_admit(self, rid: Hashable, tokens: list[int], cont: list[int], ns: Hashable = None) -> None:
        """can_admit, then admit of the same tokens: they decide by one answer (API, "Capacity").
        Checked where nothing can land in between: fake engine, no storage, no decode offload."""
        toks = np.asarray(tokens, np.int32)
        what = f"can_admit({len(toks)} tokens)"
        can, exc = await self.call(what, lambda: self.rt.can_admit(toks, ns))
        self.outcome(what, OK, exc)
        await self.check(what, exc)
        pred = self.p_admit(rid, toks, None)
        what = f"admit({rid!r}, {len(toks)} tokens) after can_admit said {can}"
        self.announce(toks, ns)
        res, exc = await self.call(what, lambda: self.rt.admit(rid, toks, ns))
        strict = self.cfg.deterministic and not self.cfg.decode_offload and not pred[0]
        if strict and can and isinstance(exc, CapacityError):
            raise self.fail("can-admit-disagrees", f"{what} raised {exc!r}")
        if strict and not can and exc is None:
            # (the write-backs a no starts cannot land first: the fake engine acks only on release)
            raise self.fail("can-admit-disagrees", f"{what} succeeded")
        if self.outcome(what, pred, exc):
            self.apply_admit(rid, toks, np.asarray(cont, np.int32), ns, None, res)
        await self.check(what, exc)

    async def x_available(self) -> None:
        res, exc = await self.call("available()", self.rt.available)
        self.outcome("available()", OK, exc)
        free, evictable = res["device_free"], res["device_evictable"]
        if not (0 <= free and 0 <= evictable and free + evictable <= self.D and free % self.ps == 0):
            raise self.fail("available-result", f"available() returned {res!r}")
        await self.check("available()", exc)

    async def x_stats(self) -> None:
        res, exc = await self.call("stats()", self.rt.stats)
        self.outcome("stats()", OK, exc)
        if res["requests"]["live"] != len(self.reqs) or res["copies"]["inflight"] < 0:
            raise self.fail("stats-result", f"stats() says {res['requests']['live']} live requests; the caller holds "
                            f"{len(self.reqs)}")
        self.check_counters("stats()", res)
        await self.check("stats()", exc)

    def check_counters(self, what: str, st: dict[str, dict[str, Any]]) -> None:
        """No counter of `st` is below what the last stats() said (docs/API.md: counters only grow)."""
        now = {(s.group, s.key): st[s.group][s.key]["count"] if s.kind is Kind.HISTOGRAM else st[s.group][s.key]
               for s in STATS if s.kind in (Kind.COUNTER, Kind.HISTOGRAM)}
        back = {f"{g}.{k}": (self.counters_seen[g, k], v) for (g, k), v in now.items()
                if v < self.counters_seen.get((g, k), 0)}
        if back:
            raise self.fail("counter-decreased", f"{what}: counters went back (before, now): {back}")
        self.counters_seen = now

    async def x_flush(self) -> None:
        def quiet(core: Any) -> bool:
            return not (core.requests or core.in_flight() or _prefetches(core) or _retired(core))

        # with nothing locked and nothing able to land meanwhile, a flush leaves an empty tree
        expect_empty = self.cfg.deterministic and await self.inspect(quiet)
        res, exc = await self.call("flush()", self.rt.flush)
        self.outcome("flush()", OK, exc)
        if type(res) is not int or res < 0:
            raise self.fail("flush-result", f"flush() returned {res!r}")
        if expect_empty:
            left = await self.inspect(lambda core: [n.id for n in core.residency.tree.nodes()])
            if left:
                raise self.fail("flush-left-nodes", f"flush() with nothing locked left nodes {left[:8]}")
        await self.check("flush()", exc)

    # -- storage controls ----------------------------------------------------------------------
    async def x_clear_storage(self, cancel: int | None = None, during: Step | None = None) -> None:
        await self._control("clear", cancel, during)

    async def x_detach_storage(self, cancel: int | None = None, during: Step | None = None) -> None:
        await self._control("detach", cancel, during)

    async def x_attach_storage(self, fresh: bool = False, bad: bool = False, cancel: int | None = None,
                               during: Step | None = None) -> None:
        """`fresh`: a new backend over the same directory instead of the one detached (only when
        the tree actor keeps no page of that one, known or in doubt: the events would still
        announce those, whether the new tier relearns or forgets each one is its own history, and
        a clear through it would leave those in doubt); `bad`: not a backend."""
        backend = self.backend
        if bad:
            backend = object()
        elif fresh and not self.attached and not self.controls_pending and self.storage_dir is not None:
            detached, old = self.rt._tree.detached_known, self.backend
            kept = await self.inspect(lambda core: _kept_record(detached, old))
            if kept is None or not (kept.known or kept.doubtful):
                backend = _storage_for(self.cfg, self.storage_dir)
                self.extra_backends.append(backend)
        await self._control("attach", cancel, during, backend, bad)

    async def _control(self, op: str, cancel: int | None, during: Step | None, backend: Any = None,
                       bad: bool = False) -> None:
        """One storage control. A valid one is sent, then `during` (another step) runs while it
        drains, then its await is cancelled after `cancel` turns (it completes all the same) or
        awaited. An invalid one (attach while attached, detach or clear while detached, not a
        backend) is a typed error that changes nothing."""
        rt = self.rt
        fresh = op == "attach" and backend is not self.backend and not bad
        what = f"{op}_storage({'fresh' if fresh else ''}{'junk' if bad else ''})"
        make: Callable[[], Awaitable[Any]] = {
            "clear": rt.clear_storage, "detach": rt.detach_storage, "attach": lambda: rt.attach_storage(backend)}[op]
        must: tuple[type, ...] = (ConfigError,) if bad else ((StateError,) if self.attached == (op == "attach") else ())
        if must:
            _, exc = await self.call(what, make)
            self.outcome(what, (must, ()), exc)
            await self.check(what, exc)
            return
        clearing = op == "clear" and self.may_store is not None
        before: set[bytes] = await self._held_pages() if clearing else set()
        if clearing:
            self.stored_during = set()
        if op != "clear":  # controls run in call order: the calls after this one meet its outcome
            self.attached, self.backend = op == "attach", backend if op == "attach" else self.backend
        task = asyncio.ensure_future(make())
        await asyncio.sleep(0)  # sent: it is queued in the tree actor before anything `during` sends
        self.controls_pending += 1
        try:
            if during is not None:
                await self.execute(during)
            res, exc = await self.call(what, lambda: task, cancel)
            if exc is CANCELLED:
                await self.wait_controls()
            elif self.outcome(what, OK, exc) and op == "clear" and (type(res) is not int or res < 0):
                raise self.fail("clear-result", f"{what} returned {res!r}")
        finally:
            self.controls_pending -= 1
        if clearing:
            # storage now holds none of our pages; what the tree held or was admitted meanwhile may
            # be written again
            assert self.stored_during is not None
            self.may_store = before | self.stored_during | await self._held_pages()
            self.stored_during = None
            await self.check_directory(what)  # nothing the clear should have removed is left
        await self.check(what, None if exc is CANCELLED else exc)

    async def _held_pages(self) -> set[bytes]:
        """Storage page hashes of everything that may be written from now on: tree copies, plans of
        live requests and sessions, and what retired requests hold (decode offload: their offloads
        still land and are written after the caller's finish or abort)."""
        (device, host, _), retired = await self.inspect(lambda core: (_resident_pages(core), [
            (z.rec.tokens.copy(), z.rec.extra_key) for z in _retired(core).values()]))
        out = set(device | host)
        for plan, ns in retired + [(r.plan, r.ns) for r in self.reqs.values()] + \
                [(x.plan, x.ns) for x in self.sessions.values()]:
            out.update(self._storage_pages(plan, ns))
        return out

    async def wait_controls(self, timeout: float = CALL_TIMEOUT_S) -> None:
        """Until the tree actor has no storage control queued (one whose await was cancelled)."""
        tree = self.rt._tree
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.inspect(lambda core: bool(tree.controls)):
            if asyncio.get_running_loop().time() > deadline:
                raise self.fail("hang", f"storage controls still queued after {timeout} s")
            await asyncio.sleep(0.0005)

    # -- pages lost behind the runtime's back ---------------------------------------------------------
    async def x_evict_pages(self, pick: float, count: int, flush: bool = False, probe: Hashable = None) -> None:
        """Another process (or a size cap) deletes `count` page files of a chain, from a page the
        runtime knows stored: the runtime learns it only when a lookup or read stops there (it and
        the pages after it are then no longer known stored, those after it held in doubt). Then
        `flush`, and `probe`: prepare that rid for the chain's tokens through its last page known
        stored. The deletion is not an API call; file storage only."""
        if self.may_store is None or self.storage_dir is None:
            return
        detached, backend = self.rt._tree.detached_known, self.backend
        known = await self.inspect(lambda core: set(core.storage.known) if core.storage.attached
                                   else set(_kept(detached, backend) or ()))
        keys, tokens, ns = self._eviction(known, pick, count)
        if not keys:
            return
        if self.evictor is None:
            self.evictor = _storage_for(self.cfg, self.storage_dir)
            self.extra_backends.append(self.evictor)
        self.evicted.update(keys)
        removed = self.evictor.remove(keys)
        self.outcomes.append(f"evict {len(keys)} pages -> {removed} removed")
        await self.check(f"deleting {removed} page files behind the runtime's back", None)
        if flush:
            await self.x_flush()
        if probe is not None and tokens and probe not in self.reqs and probe not in self.prepared:
            await self.x_prepare(probe, tokens, ns)
            await self.landed(probe)
            # its lookup stopped at the first page deleted: the events report it and the pages after
            # it removed from STORAGE as the tier forgets them
            await self.check_events("deleting page files, a prepare")
        await self.check_directory(f"deleting page files{', a prepare' if probe is not None else ''}")

    async def landed(self, rid: Hashable, timeout: float = CALL_TIMEOUT_S) -> None:
        """Until the prefetch of prepared `rid` (if any) has landed: its lookup and read acked (the
        fake engine plays no part in them)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while await self.inspect(lambda core: rid in _prefetches(core)):
            if asyncio.get_running_loop().time() > deadline:
                raise self.fail("hang", f"the prefetch of {rid!r} did not land in {timeout} s")
            await asyncio.sleep(0.0005)

    def _eviction(self, known: set[bytes], pick: float, count: int) -> tuple[list[bytes], list[int], Hashable]:
        """The pages to delete, with the tokens of their chain through its last page known stored
        (and one more token) and its namespace: from a page known stored with a page known stored
        after it in one of the model's chains (plans of live requests and sessions, the
        vocabulary's conversations in every namespace), `count` pages on but never its last page
        known stored (a lookup stopping there must leave a page behind); else any page known."""
        cands: list[tuple[list[bytes], list[int], Hashable]] = []
        seen: set[bytes] = set()
        for plan, ns, chain in self._chains():
            stored = [i for i, h in enumerate(chain) if h in known]
            toks = [int(t) for t in plan[: (stored[-1] + 1) * self.ps + 1]] if stored else []
            for i in stored[:-1]:  # a lookup stops there while later pages remain
                if chain[i] not in seen:
                    seen.add(chain[i])
                    cands.append((chain[i: min(i + count, stored[-1])], toks, ns))
        if not cands:
            cands = [([h], [], None) for h in sorted(known)]
        return cands[int(pick * len(cands))] if cands else ([], [], None)

    def _chains(self) -> list[tuple[np.ndarray, Hashable, list[bytes]]]:
        """(plan, namespace, storage page hashes) of the model's chains."""
        if self._vocab_chains is None:
            self._vocab_chains = [(p, ns, self._storage_pages(p, ns)) for p in
                                  (np.asarray(toks, np.int32) for toks, _ in self.vocab.convs)
                                  for ns in dict.fromkeys(Vocab.NAMESPACES)]
        live = [(r.plan, r.ns) for r in self.reqs.values()] + [(s.plan, s.ns) for s in self.sessions.values()]
        return [(plan, ns, self._storage_pages(plan, ns)) for plan, ns in live] + self._vocab_chains

    async def x_batch(self, items: list[tuple[str, dict[str, Any]]], cancel: int | None = None) -> None:
        msgs: list[Any] = []
        toks_of: list[np.ndarray | None] = []
        for kind, a in items:
            rid = a["rid"]
            r = self.reqs.get(rid)
            toks = None
            if kind == "admit":
                toks = np.asarray(a["tokens"], np.int32)
                self.announce(toks, a.get("ns"))
                msgs.append(Admit(rid, toks, a.get("ns")))
            elif kind == "extend":
                msgs.append(Extend(rid, a["n"]))
            elif kind == "commit":
                if r is not None:
                    await self.compute(r, a["c"])
                msgs.append(Commit(rid, a["c"]))
            elif kind in ("cache", "finish"):
                toks = self.tokens_of(rid, a["m"], a.get("flip"), a.get("tokens"))
                if r is not None:
                    await self.compute(r, len(toks))
                msgs.append(Cache(rid, toks) if kind == "cache" else Finish(rid, toks, a.get("finished_len")))
            else:
                msgs.append(Abort(rid))
            toks_of.append(toks)
        what = "step([" + ", ".join(f"{k}({a['rid']!r})" for k, a in items) + "])"
        # a step whose items are all admits may be cancelled: its admissions are released
        only_admits = all(k == "admit" for k, _ in items)
        # an admit item may start a load that a later cache or finish item meets
        loading = any(k == "admit" for k, _ in items) or await self.loading()
        admitted = {a["rid"] for k, a in items if k == "admit"}
        self.loading_when_sent = {
            a["rid"] for k, a in items if k in ("cache", "finish") and (
                a["rid"] in admitted or (a["rid"] in self.reqs and self._load_doubt(self.reqs[a["rid"]])[1]))}
        try:
            res, exc = await self.call(what, lambda: self.rt.step(msgs), cancel if only_admits else None)
            await self._judge_step(what, items, toks_of, res, exc, loading)
        finally:
            self.loading_when_sent = set()

    async def _judge_step(self, what: str, items: list[tuple[str, dict[str, Any]]], toks_of: list[np.ndarray | None],
                          res: Any, exc: Any, loading: bool) -> None:
        if exc is CANCELLED:
            await self.check(what + " cancelled", None)
            return
        if exc is not None:
            raise self.fail("step-raised", f"{what} raised {exc!r}")
        if type(res) is not tuple or len(res) != len(items):
            raise self.fail("step-result", f"{what} returned {res!r}")
        any_error = None
        for (kind, a), toks, r in zip(items, toks_of, res):
            rid = a["rid"]
            err = r if isinstance(r, BaseException) else None
            if err is not None and not isinstance(err, CallerError):
                raise self.fail("step-result", f"{what}: item {kind}({rid!r}) gave {err!r}")
            any_error = any_error or err
            sub = f"{what} item {kind}({rid!r})"
            if kind == "admit":
                if self.outcome(sub, self.p_admit(rid, toks, None), err):
                    self.apply_admit(rid, toks, np.asarray(a["cont"], np.int32), a.get("ns"), None, r)
            elif kind == "extend":
                if self.outcome(sub, self.p_extend(rid, a["n"]), err):
                    self.apply_extend(self.reqs[rid], a["n"], r)
            elif kind == "commit":
                if self.outcome(sub, self.p_commit(rid, a["c"]), err):
                    if r != a["c"]:
                        raise self.fail("commit-result", f"{sub} returned {r!r}")
                    self.reqs[rid].committed = a["c"]
            elif kind == "cache":
                self.apply_cache(rid, toks, self.p_cache(rid, toks), r, err, sub, loading)
            elif kind == "finish":
                self.apply_finish(rid, toks, a.get("finished_len"), self.p_finish(rid, toks, a.get("finished_len")),
                                  r, err, sub, loading)
            else:
                if self.outcome(sub, self.p_abort(rid), err) and rid in self.reqs:
                    self.release(rid)
                self.prepared.discard(rid)
        # an item refused by validation changes nothing, but the others do (a TransferError of a
        # finish releases its request): only a batch of validation errors is compared whole
        all_refused = all(isinstance(r, ValidationError) for r in res)
        await self.check(what, any_error if all_refused else None)

    async def x_release(self, which: int, layers: int | None = None, fail: bool = False, loads: bool = False) -> None:
        """Complete (or fail) one copy in flight (`loads`: one load); wait for its ack (not an API call)."""
        if self.engine is None:
            await asyncio.sleep(0.001)  # the CPU engine's copies land by themselves
            return
        pending = self.engine.pending(Direction.LOAD if loads else None)
        if not pending:
            return
        op = pending[which % len(pending)]
        try:
            if fail:
                self.engine.fail(op, RuntimeError("injected copy fault"))
            else:
                self.engine.release(op, layers)
        except StateError:
            return
        if fail or layers is None:
            await self.wait_acks()
            await self.check(f"{'failing' if fail else 'completing'} copy {op}", None)

    async def x_settle(self) -> None:
        await self.settle()
        await self.check("settling every copy", None)

    async def x_bad(self, kind: str, rid: Hashable = "r0") -> None:
        """Arguments of a wrong type or value: refused by the façade, nothing sent."""
        rt = self.rt
        calls: dict[str, tuple[Callable[[], Awaitable[Any]], tuple[type, ...]]] = {
            "float_rid": (lambda: rt.admit(1.5, [1, 2, 3]), (ArgumentError,)),
            "bool_tokens": (lambda: rt.admit("bad", [True, 2, 3]), (TokenError,)),
            "negative_token": (lambda: rt.cache(rid, [-1, 2]), (TokenError,)),
            "float_count": (lambda: rt.extend(rid, 1.0), (LengthError,)),
            "float_finished_len": (lambda: rt.finish(rid, [1, 2], 1.0), (LengthError,)),
            "list_namespace": (lambda: rt.match_prefix([1, 2, 3], ["ns"]), (ArgumentError,)),
            "int_insert": (lambda: rt.close_session("s-none", insert=1), (ArgumentError,)),
        }
        make, must = calls[kind]
        what = f"bad call {kind}"
        _, exc = await self.call(what, make)
        self.outcome(what, (must, ()), exc)
        await self.check(what, exc)

    async def x_step_junk(self) -> None:
        what = "step(['junk'])"
        res, exc = await self.call(what, lambda: self.rt.step(["junk"]))
        if exc is not None or type(res) is not tuple or not isinstance(res[0], ArgumentError):
            raise self.fail("step-result", f"{what} gave {res!r} / {exc!r}")
        await self.check(what, res[0])

    # -- generation -------------------------------------------------------------------------------------
    def _live(self) -> list[Hashable]:
        return list(self.reqs)

    def _pick(self, seq: list[Any]) -> Any:
        return self.rng.choice(seq) if seq else None

    def _ghost(self) -> Hashable:
        return self._pick(self.gone) if self.gone and self.rng.random() < 0.6 else f"ghost{self.rng.randrange(4)}"

    def _new_rid(self) -> Hashable:
        free = [g for g in self.gone if g not in self.reqs and g not in self.prepared]
        if free and self.rng.random() < 0.15:
            return self.rng.choice(free)  # a released rid comes back (a new generation)
        self.next_rid += 1
        return f"r{self.next_rid}"

    def generate(self) -> Step:
        rng = self.rng
        live = len(self.reqs)
        fake = self.engine is not None
        table: list[tuple[float, Callable[[], Step | None]]] = [
            (14 if live < 4 else 4, self.g_admit),
            (6, self.g_compute),
            (10, self.g_extend),
            (6, self.g_commit),
            (5, self.g_decode),
            (8, self.g_cache),
            (10 if live < 4 else 18, self.g_finish),
            (3, self.g_abort),
            (4, self.g_rewind),
            (6, self.g_batch),
            (4, self.g_crowd),
            (1.5, self.g_open_session),
            (4, self.g_turn),
            (1.5, self.g_close_session),
            (3 if self.cfg.storage != "none" else 0.3, self.g_prepare),
            (2, self.g_match_prefix),
            (2, self.g_can_admit),
            (2, self.g_can_then_admit),
            (1, lambda: ("available", {})),
            (1, lambda: ("stats", {})),
            (1, lambda: ("flush", {})),
            (14 if fake else 2, self.g_release),
            (1, lambda: ("settle", {})),
            (1, self.g_bad),
            # last, and 0 without storage: the draws of episodes without storage stay as they were
            *self._control_weights(),
            (2 if self.may_store is not None else 0, self.g_evict_pages),
            (12 if self.cfg.hybrid else 0, self.g_snapshot),
        ]
        weights = [w for w, _ in table]
        while True:
            _, make = rng.choices(table, weights)[0]
            step = make()
            if step is not None:
                return step

    def _control_weights(self) -> list[tuple[float, Callable[[], Step | None]]]:
        if self.cfg.storage in ("none", "peer"):  # (a peer removes nothing: no clear_storage)
            return [(0, self.g_storage_control)]
        return [(1.5 if self.attached else 3, self.g_storage_control)]

    def g_storage_control(self, nested: bool = False) -> Step:
        """clear / detach while attached (now and then the wrong one: a StateError), attach while
        detached (same backend, a fresh one over the same directory, or junk), with another step
        running while it drains, or its await cancelled."""
        rng = self.rng
        if self.attached:
            op = rng.choice(("clear", "clear", "detach")) if not self._bad(0.1) else "attach"
        else:
            op = "attach" if not self._bad(0.15) else rng.choice(("clear", "detach"))
        args: dict[str, Any] = {}
        if op == "attach":
            args = {"fresh": rng.random() < 0.3, "bad": self._bad(0.05)}
        if not nested and rng.random() < 0.5:
            make = rng.choice((self.g_admit, self.g_prepare, self.g_finish, self.g_release, self.g_crowd,
                               lambda: ("flush", {}), lambda: self.g_storage_control(nested=True)))
            during = make()
            if during is not None and during[0] != "clear_storage":  # (one clear at a time: `may_store`)
                args["during"] = during
        if not nested and rng.random() < 0.15:
            args["cancel"] = rng.choice((0, 1))
        return f"{op}_storage", args

    def g_evict_pages(self) -> Step:
        """A few page files go behind the runtime's back: which ones is picked when the step runs,
        from what the runtime then knows stored (`pick`: where in the list of candidates); often
        a flush and a prepare of their chain follow (the lookup then starts before them)."""
        rng = self.rng
        return "evict_pages", {"pick": rng.random(), "count": rng.choice((1, 1, 2, 3)), "flush": rng.random() < 0.4,
                               "probe": self._new_rid() if rng.random() < 0.7 else None}

    def g_snapshot(self) -> Step | None:
        """The engine asks for a state snapshot of a live request: mostly at a page boundary past its
        cached prefix it has not asked for yet, half of those at the last page boundary before its
        prompt's last token (as far as an admit of the same prompt, or of a later turn, resumes);
        now and then at or below the cached prefix, past its tokens, not page-aligned, twice, not an
        int, or of a rid that is not live."""
        rng, ps = self.rng, self.ps
        # (a request with a position left, when there is one)
        rid = self._pick([x for x in self._live() if self._snapshot_positions(self.reqs[x])] or self._live())
        if rid is None:
            return None
        r = self.reqs[rid]
        valid = self._snapshot_positions(r)
        if valid and not self._bad(0.15):
            prompt_end = _down(r.prompt_len - 1, ps)
            at = prompt_end if prompt_end in valid and rng.random() < 0.5 else rng.choice(valid)
            return "snapshot", {"rid": rid, "position": at}
        bad = [r.cached, _up(r.seq_len + 1, ps), *r.snaps, float(r.cached + ps)] + ([r.cached + 1] if ps > 1 else [])
        return "snapshot", {"rid": self._ghost() if self._bad(0.2) else rid, "position": rng.choice(bad)}

    def _snapshot_positions(self, r: Req) -> list[int]:
        return [p for p in range(r.cached + self.ps, r.seq_len + 1, self.ps) if p not in r.snaps]

    def _bad(self, p: float = 0.12) -> bool:
        return self.rng.random() < p

    def g_admit(self) -> Step:
        rng = self.rng
        toks, cont = self.vocab.prompt()
        ns = self.vocab.namespace()
        rid = self._new_rid()
        if self._bad():
            choice = rng.randrange(3)
            if choice == 0 and self.reqs:
                rid = rng.choice(self._live())  # duplicate of a live rid
            elif choice == 1:
                toks, cont = [], list(toks) + cont  # empty
            else:
                toks, cont = self.vocab.rand(self.D + rng.randint(0, 1)), []  # the whole pool, or more
        cancel = rng.choice((0, 1)) if rng.random() < 0.06 else None
        return "admit", {"rid": rid, "tokens": toks, "cont": cont[: max(0, self.D - len(toks))], "ns": ns,
                         "session": None, "cancel": cancel}

    def g_compute(self) -> Step | None:
        rid = self._pick(self._live())
        if rid is None:
            return None
        r = self.reqs[rid]
        return "compute", {"rid": rid, "upto": self.rng.randint(r.computed, r.seq_len)}

    def g_extend(self) -> Step | None:
        rid = self._pick(self._live())
        if rid is None or self._bad(0.08):
            return "extend", {"rid": self._ghost() if rid is None or self._bad(0.5) else rid,
                              "n": self.rng.choice((0, -1, self.D))}
        return "extend", {"rid": rid, "n": self.rng.randint(1, 2 * self.ps)}

    def g_decode(self) -> Step | None:
        live = self._live()
        if not live:
            return None
        if self.last_decode and self.rng.random() < 0.5:
            # an engine steps the same batch again and again (the runtime reuses its rows): as it
            # was, or without the requests that ended since
            rids = list(self.last_decode)
            if self.rng.random() < 0.5:
                rids = [rid for rid in rids if rid in self.reqs] or rids
        else:
            rids = self.rng.sample(live, self.rng.randint(1, len(live)))
            if self._bad(0.1):
                rids.insert(self.rng.randrange(len(rids) + 1), self._ghost() if self._bad(0.5) else rids[0])
        self.last_decode = rids
        return "decode", {"rids": rids}

    def g_commit(self) -> Step | None:
        rid = self._pick(self._live())
        if rid is None:
            return None
        r = self.reqs[rid]
        if self._bad(0.1):
            return "commit", {"rid": rid, "c": self.rng.choice((r.committed - 1, r.seq_len + 1))}
        return "commit", {"rid": rid, "c": self.rng.choice((r.seq_len, self.rng.randint(r.committed, r.seq_len)))}

    def _m(self, r: Req) -> int:
        rng = self.rng
        n = max(1, r.seq_len)  # a rewind to 0 leaves nothing: 1 token is then one too many
        return rng.choice((n, n, max(1, n - 1), rng.randint(1, n)))

    def g_cache(self) -> Step | None:
        rid = self._pick([x for x in self._live() if self.reqs[x].session is None] or self._live())
        if rid is None:
            return None
        r = self.reqs[rid]
        m, flip = self._m(r), None
        if self._bad():
            if self.rng.random() < 0.5 and min(m, r.record_len) > 0:
                flip = self.rng.randrange(min(m, r.record_len))  # tokens that contradict its record
            else:
                m = r.seq_len + self.rng.randint(1, 3)  # more tokens than it has slots for
        return "cache", {"rid": rid, "m": m, "flip": flip}

    def g_finish(self) -> Step | None:
        rng = self.rng
        rid = self._pick(self._live())
        if rid is None or self._bad(0.06):
            return "finish", {"rid": self._ghost(), "m": 3, "tokens": [1, 2, 3]}  # double finish / unknown
        r = self.reqs[rid]
        m, fl, flip = self._m(r), None, None
        if m >= r.prompt_len and rng.random() < 0.4:
            fl = rng.randint(0, m - r.prompt_len)
        if self._bad(0.1):
            c = rng.randrange(3)
            if c == 0:
                fl = rng.choice((-1, m - r.prompt_len + 1))
            elif c == 1 and min(m, r.record_len) > 0:
                flip = rng.randrange(min(m, r.record_len))
            else:
                m = r.seq_len + 1
        return "finish", {"rid": rid, "m": m, "finished_len": fl, "flip": flip}

    def g_abort(self) -> Step:
        rid = self._pick(self._live())
        return "abort", {"rid": rid if rid is not None and not self._bad(0.2) else self._ghost()}

    def g_rewind(self) -> Step | None:
        rid = self._pick(self._live())
        if rid is None:
            return None
        r = self.reqs[rid]
        floor = r.session_kv if r.session is not None else r.cached
        if self._bad(0.15):
            n = self.rng.choice((floor - 1, r.seq_len + 1)) if floor else r.seq_len + 1
            return "rewind", {"rid": rid, "new_len": n}
        n = self.rng.randint(floor, r.seq_len)
        redraw = self.vocab.rand(self.D - n) if self.rng.random() < 0.5 else None
        return "rewind", {"rid": rid, "new_len": n, "redraw": redraw}

    def g_batch(self) -> Step:
        rng = self.rng
        items: list[tuple[str, dict[str, Any]]] = []
        used: set[Hashable] = set()
        for _ in range(rng.randint(1, 4)):
            live = [x for x in self._live() if x not in used]
            kind = rng.choice(("admit", "admit", "extend", "commit", "cache", "finish", "abort")) if live else "admit"
            if kind == "admit":
                _, a = self.g_admit()
                if a["rid"] in used or a["rid"] in self.reqs and not self._bad(0.3):
                    continue
                a = {k: a[k] for k in ("rid", "tokens", "cont", "ns")}
            else:
                step = {"extend": self.g_extend, "commit": self.g_commit, "cache": self.g_cache,
                        "finish": self.g_finish, "abort": self.g_abort}[kind]()
                if step is None:
                    continue
                a = dict(step[1])
                if a["rid"] in used:
                    continue
            used.add(a["rid"])
            items.append((kind, a))
        if not items:
            return "stats", {}
        cancel = rng.choice((0, 1)) if rng.random() < 0.08 else None
        return "batch", {"items": items, "cancel": cancel}

    def _pressure(self) -> dict[str, Any]:
        return {"rid": self._new_rid(), "tokens": self.vocab.rand(self.D - 1), "cont": self.vocab.rand(1)}

    def g_crowd(self) -> Step:
        """Users of one conversation arriving together: one batch of admits at its turn boundaries,
        shortest first, so that each one's load from host may start under the one before it; often
        right after a long unrelated prompt pushed the conversation off device."""
        rng, D = self.rng, self.D
        pressure = self._pressure() if rng.random() < 0.6 else None
        toks, bounds = rng.choice(self.vocab.convs)
        bounds = [b for b in bounds if b <= max(1, int(self.vocab.max_prompt * D))] or bounds[:1]
        ns = self.vocab.namespace()
        items: list[tuple[str, dict[str, Any]]] = []
        for b in sorted(set(rng.sample(bounds, min(len(bounds), rng.randint(2, 3))))):
            rid = self._new_rid()
            b = max(1, min(b, D - 1))
            if rid in self.reqs or any(a["rid"] == rid for _, a in items):
                continue
            items.append(("admit", {"rid": rid, "tokens": toks[:b], "cont": toks[b:D], "ns": ns}))
        if not items:
            return "stats", {}
        fail = self.cfg.copy_faults and len(items) > 1 and rng.random() < 0.3
        return "crowd", {"pressure": pressure, "items": items, **({"fail_first_load": True} if fail else {})}

    def g_open_session(self) -> Step:
        if self.sessions and self._bad(0.1):
            sid = self.rng.choice(list(self.sessions))
        else:
            self.next_sid += 1
            sid = f"s{self.next_sid}"
        return "open_session", {"sid": sid, "plan": self.vocab.conversation(), "ns": self.vocab.namespace()}

    def g_turn(self) -> Step | None:
        rng = self.rng
        idle = [s for s in self.sessions.values() if s.turn is None]
        if not self.sessions:
            return None
        s = rng.choice(idle) if idle and not self._bad(0.08) else rng.choice(list(self.sessions.values()))
        if s.kv >= self.D - 1:
            return "close_session", {"sid": s.sid, "insert": rng.random() < 0.5}
        b = min(self.D - 1, s.kv + rng.randint(1, 2 * self.vocab.unit))
        plan = [int(t) for t in s.plan]
        toks = plan[:b]
        if self._bad(0.08) and s.kv:
            toks[rng.randrange(s.kv)] = (toks[0] + 1) % VOCAB  # does not extend the session
        cancel = rng.choice((0, 1)) if rng.random() < 0.04 else None
        rid = self._new_rid()
        return "admit", {"rid": rid, "tokens": toks, "cont": plan[b: self.D], "ns": None, "session": s.sid,
                         "cancel": cancel}

    def g_close_session(self) -> Step | None:
        if not self.sessions or self._bad(0.1):
            return "close_session", {"sid": "s-none", "insert": False}
        return "close_session", {"sid": self.rng.choice(list(self.sessions)), "insert": self.rng.random() < 0.5}

    def g_prepare(self) -> Step:
        toks, _ = self.vocab.prompt()
        return "prepare", {"rid": self._new_rid(), "tokens": toks, "ns": self.vocab.namespace()}

    def _question_tokens(self) -> tuple[list[int], Hashable]:
        toks, cont = self.vocab.prompt()
        return (toks + cont)[: self.rng.randint(1, self.D)], self.vocab.namespace()

    def g_match_prefix(self) -> Step:
        toks, ns = self._question_tokens()
        return "match_prefix", {"tokens": toks, "ns": ns, "cancel": 1 if self.rng.random() < 0.05 else None}

    def g_can_admit(self) -> Step:
        toks, ns = self._question_tokens()
        return "can_admit", {"tokens": toks, "ns": ns, "cancel": 1 if self.rng.random() < 0.05 else None}

    def g_can_then_admit(self) -> Step:
        toks, cont = self.vocab.prompt()
        if self.rng.random() < 0.3:  # a long one: capacity is the question
            toks, cont = (toks + cont)[: self.rng.randint(self.D // 2, self.D - 1)], []
            cont = self.vocab.rand(self.D - len(toks))
        return "can_then_admit", {"rid": self._new_rid(), "tokens": toks, "cont": cont, "ns": self.vocab.namespace()}

    def g_release(self) -> Step:
        rng = self.rng
        fail = self.cfg.copy_faults and rng.random() < 0.12
        layers = 0 if not fail and rng.random() < 0.1 else None
        # a failure often hits the oldest copy in flight: the ones issued after it (loads started
        # under it) are still pending, and its rollback must take them into account
        which = 0 if fail and rng.random() < 0.5 else rng.randrange(1 << 16)
        return "release", {"which": which, "layers": layers, "fail": fail}

    def g_bad(self) -> Step:
        if self.rng.random() < 0.15:
            return "step_junk", {}
        kind = self.rng.choice(("float_rid", "bool_tokens", "negative_token", "float_count", "float_finished_len",
                                "list_namespace", "int_insert"))
        return "bad", {"kind": kind, "rid": self._pick(self._live()) or "r0"}

    # -- the end of an episode ---------------------------------------------------------------------------
    async def teardown(self) -> None:
        """Release everything, wait until nothing is in flight, check that nothing leaked."""
        self.index = len(self.steps)
        for rid in list(self.reqs):
            await self.x_abort(rid)
        for sid in list(self.sessions):
            await self.x_close_session(sid, insert=len(str(sid)) % 2 == 0)
        await self.settle()
        err = await self.inspect(lambda core: _quiescent_error(core))
        if err:
            raise self.fail("leak", f"after releasing everything: {err}")
        await self.check_tree("teardown")
        st, exc = await self.call("stats()", self.rt.stats)
        self.outcome("stats()", OK, exc)
        self.final_stats = st
        self.check_counters("teardown stats()", st)
        busy = {f"{g}.{k}": st[g][k] for g, k in (("requests", "live"), ("copies", "inflight"), ("storage", "inflight"),
                                                   ("storage", "calls_running"), ("offload", "inflight"),
                                                   ("offload", "retired_requests"))}
        if any(busy.values()):
            raise self.fail("leak", f"stats() after releasing everything: {busy}")
        av, exc = await self.call("available()", self.rt.available)
        self.outcome("available()", OK, exc)
        # (sliding: a free page needs a sliding page too; the tree's pages without one are evictable, so
        # free + evictable lies between the smaller pool and the full one)
        least = self.D if self.swa is None else min(self.D, self.cfg.swa_pages * self.ps)
        if not least <= av["device_free"] + av["device_evictable"] <= self.D:
            raise self.fail("leak", f"with nothing live, {self.D - av['device_free'] - av['device_evictable']} "
                            f"device slots are neither free nor evictable: {av}")


def _quiescent_error(core: Any) -> str | None:
    try:
        check_invariants(core, quiescent=True)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    if core.sessions:
        return f"sessions left: {list(core.sessions)}"
    return None


# -- episodes -------------------------------------------------------------------------------------------


@dataclass
class EpisodeResult:
    cfg: FuzzConfig
    steps: list[Step]
    calls: int
    violation: Violation | None
    outcomes: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] | None = None  # stats() after the teardown (None: it did not get there)


def episode_rng(seed: int, episode: int) -> random.Random:
    return random.Random(f"hicache-fuzz:{seed}:{episode}")


async def _close(rt: CacheRuntime, engine: FakeCopyEngine | None) -> None:
    """Close, completing the fake engine's copies while close waits for them."""
    closing = asyncio.ensure_future(rt.close())
    while not closing.done():
        if engine is not None:
            for op in engine.pending():
                try:
                    engine.release(op)
                except Exception:  # noqa: BLE001
                    pass
        await asyncio.sleep(0.001)
    await closing


def _kept_record(detached: Any, backend: Any) -> StoredPages | None:
    """What the tree actor keeps for a detached `backend` (its weak-keyed record)."""
    return None if backend is None else detached.get(backend)


def _kept(detached: Any, backend: Any) -> set[bytes] | None:
    """The page hashes the tree actor keeps known stored for a detached `backend`."""
    kept = _kept_record(detached, backend)
    return None if kept is None else kept.known


def _page_files(directory: str) -> set[bytes]:
    """The page hashes of the page files in a `FileBackend` directory (its fan-out layout)."""
    out: set[bytes] = set()
    for sub in FANOUT:
        with os.scandir(os.path.join(directory, sub)) as it:
            out.update(bytes.fromhex(e.name[:-len(PAGE_SUFFIX)]) for e in it if e.name.endswith(PAGE_SUFFIX))
    return out


def _resident_pages(core: Any, detached: set[bytes] | None = None
                    ) -> tuple[frozenset[bytes], frozenset[bytes], frozenset[bytes]]:
    """Page hashes of every device copy, every host copy, and the pages storage is known to hold:
    with no tier attached, `detached` (what the tree actor keeps for the backend detached last: a
    detach announces no removal, the pages are still in that backend)."""
    tree = core.residency.tree
    identity = KVIdentity.from_config(core.config)
    device: set[bytes] = set()
    host: set[bytes] = set()
    for node in tree.nodes():
        if node.device is None and node.host is None:
            continue
        path = tree.path_tokens(node)
        mine = page_hashes(path, core.page_size, node.extra_key, identity)[(len(path) - node.num_tokens) // core.page_size:]
        if node.device is not None:
            device.update(mine)
        if node.host is not None:
            host.update(mine)
    known = core.storage.known if core.storage.attached else detached or set()
    return frozenset(device), frozenset(host), frozenset(known)


async def run_episode_async(cfg: FuzzConfig, rng: random.Random, steps: list[Step] | None = None,
                            teardown: bool = True) -> EpisodeResult:
    """One episode: generated from `rng` (steps None) or replayed from `steps`; without `teardown`
    (a shrink replay looking for a violation of the steps themselves) it ends with a plain close."""
    tmp = tempfile.mkdtemp(prefix="hicache-fuzz-") if cfg.storage in ("file", "faulty") else None
    storage = _storage_for(cfg, tmp) if cfg.storage != "none" else None
    violation: Violation | None = None
    driver: Driver | None = None
    try:
        rt = CacheRuntime(cfg.runtime_config(), engine_factory=_engine_factory(cfg), storage=storage)
        await rt._sup.start()
        engine = rt.engine if isinstance(rt.engine, FakeCopyEngine) else None
        driver = Driver(rt, cfg, rng, tmp)
        try:
            await driver.run(steps)
            if teardown:
                await driver.teardown()
        except Violation as exc:
            violation = exc
        finally:
            await _close(rt, engine)
        if violation is None and teardown:
            violation = await _after_close(rt, driver)
    finally:
        for backend in ([storage] if storage is not None else []) + (driver.extra_backends if driver else []):
            backend.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    assert driver is not None
    return EpisodeResult(cfg, driver.steps, driver.calls, violation, driver.outcomes, driver.final_stats)


async def _after_close(rt: CacheRuntime, driver: Driver) -> Violation | None:
    step = len(driver.steps)
    if rt.failed:
        return Violation("runtime-failed", f"at close: {rt._sup.failure!r}", step)
    err = _quiescent_error(rt._core)  # the actors are stopped: the state at rest, read directly
    if err:
        return Violation("leak", f"after close: {err}", step)
    for what, make in (("admit", lambda: rt.admit("after-close", [1, 2, 3])), ("stats", rt.stats),
                       ("extend", lambda: rt.extend("r1", 1))):
        try:
            async with asyncio.timeout(5):
                await make()
        except RuntimeClosed:
            continue
        except Exception as exc:  # noqa: BLE001
            return Violation("after-close", f"{what} after close raised {exc!r}, not RuntimeClosed", step)
        return Violation("after-close", f"{what} after close succeeded", step)
    driver.calls += 3
    return None


def run_episode(cfg: FuzzConfig, rng: random.Random, steps: list[Step] | None = None,
                teardown: bool = True) -> EpisodeResult:
    return asyncio.run(run_episode_async(cfg, rng, steps, teardown))


def is_hybrid(seed: int, episode: int) -> bool:
    """Whether an episode has recurrent state: drawn apart from the episode's own stream, so the
    other episodes draw exactly what they drew before hybrid ones existed."""
    return random.Random(f"hicache-fuzz-hybrid:{seed}:{episode}").random() < HYBRID_SHARE


def generate_episode(seed: int, episode: int) -> tuple[FuzzConfig, random.Random]:
    rng = episode_rng(seed, episode)
    return draw_config(rng, is_hybrid(seed, episode)), rng


# -- shrinking --------------------------------------------------------------------------------------------


def _fails(cfg: FuzzConfig, steps: list[Step], kind: str, tries: int, teardown: bool) -> bool:
    for _ in range(tries):
        res = run_episode(cfg, random.Random(0), steps, teardown)
        if res.violation is not None and res.violation.kind == kind:
            return True
    return False


def shrink(cfg: FuzzConfig, steps: list[Step], violation: Violation, budget_s: float = 60.0) -> list[Step]:
    """Delta debugging over the recorded steps: drop chunks (halves, quarters, ...), then single
    steps, keeping a candidate when its replay still fails with the same kind of violation.
    Bounded by `budget_s`; non-deterministic configurations get two tries per candidate."""
    deadline = time.monotonic() + budget_s
    tries = 1 if cfg.deterministic else 2
    kind = violation.kind
    # a violation of the steps themselves needs no teardown in the replays (a leak found there does)
    teardown = violation.step is None or violation.step >= len(steps)
    cur = list(steps[: (len(steps) if violation.step is None else violation.step) + 1])
    if not _fails(cfg, cur, kind, tries, teardown):
        cur = list(steps)
    n = 2
    while len(cur) >= 2 and time.monotonic() < deadline:
        chunk = max(1, len(cur) // n)
        removed = False
        start = 0
        while start < len(cur) and time.monotonic() < deadline:
            cand = cur[:start] + cur[start + chunk:]
            if cand and _fails(cfg, cand, kind, tries, teardown):
                cur = cand
                removed = True
            else:
                start += chunk
        if chunk == 1 and not removed:
            break
        n = n if removed else min(len(cur), n * 2)
    # then the items of batch steps, one at a time
    for i in range(len(cur)):
        j = 0
        while cur[i][0] == "batch" and j < len(cur[i][1]["items"]) and time.monotonic() < deadline:
            items = cur[i][1]["items"]
            if len(items) > 1:
                cand = cur[:i] + [("batch", {**cur[i][1], "items": items[:j] + items[j + 1:]})] + cur[i + 1:]
                if _fails(cfg, cand, kind, tries, teardown):
                    cur = cand
                    continue
            j += 1
    return cur


# -- the fuzz loop and its report -------------------------------------------------------------------------------


# the storage counters a report sums over peer episodes (what the fake peer's faults led to)
PEER_STATS = ("reads_issued", "hit_tokens", "read_failures", "ops_overdue", "rejected_pages", "backend_errors")


@dataclass
class FuzzReport:
    seed: int
    episodes: int = 0
    calls: int = 0
    seconds: float = 0.0
    failure: EpisodeResult | None = None
    failed_episode: int | None = None
    shrunk: list[Step] | None = None
    calls_to_find: int | None = None
    passed_over: list[tuple[int, Violation]] = field(default_factory=list)  # violations `want` did not ask for
    # sliding episodes: how many ran, and what their runtimes counted (`swa` stats, summed)
    swa_episodes: int = 0
    swa: dict[str, int] = field(default_factory=dict)
    # peer episodes: how many ran, and what their storage tiers counted (`storage` stats, summed)
    peer_episodes: int = 0
    peer: dict[str, int] = field(default_factory=dict)

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds if self.seconds else 0.0

    def count(self, res: EpisodeResult) -> None:
        self.episodes += 1
        self.calls += res.calls
        if res.cfg.sliding:
            self.swa_episodes += 1
            for key, value in ((res.stats or {}).get("swa") or {}).items():
                if key in ("pages_dropped", "cut_backs", "cut_tokens"):
                    self.swa[key] = self.swa.get(key, 0) + value
        if res.cfg.storage == "peer":
            self.peer_episodes += 1
            for key, value in ((res.stats or {}).get("storage") or {}).items():
                if key in PEER_STATS:
                    self.peer[key] = self.peer.get(key, 0) + value

    def summary(self) -> str:
        swa = (f"; {self.swa_episodes} sliding episodes: "
               + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.swa.items())) if self.swa_episodes else ""
        peer = (f"; {self.peer_episodes} peer episodes, storage: "
                + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in self.peer.items())) if self.peer_episodes else ""
        return (f"API fuzzer: seed {self.seed}, {self.episodes} episodes, {self.calls} API calls in "
                f"{self.seconds:.1f} s ({self.calls_per_s:.0f} calls/s){swa}{peer}")


def fuzz(seed: int, min_calls: int, *, max_seconds: float = 1e9, first_episode: int = 0, shrink_s: float = 60.0,
         want: Callable[[Violation], bool] | None = None, log: Callable[[str], None] | None = None,
         only: Callable[[FuzzConfig], bool] | None = None,
         episodes: Callable[[int, int], tuple[FuzzConfig, random.Random]] = generate_episode) -> FuzzReport:
    """Episodes `first_episode`, ... of `seed` until `min_calls` API calls ran (or `max_seconds`
    passed); stops at the first violation (the first one `want` accepts, when given: the others
    are recorded in `passed_over`) and shrinks it for `shrink_s` seconds. `only`: run just the
    episodes whose configuration it accepts (the others are skipped, keeping their numbers).
    `episodes`: which stream of episodes (`peer_episode`: the peer episodes)."""
    report = FuzzReport(seed)
    t0 = time.monotonic()
    ep = first_episode
    while report.calls < min_calls and time.monotonic() - t0 < max_seconds:
        cfg, rng = episodes(seed, ep)
        if only is not None and not only(cfg):
            ep += 1
            continue
        res = run_episode(cfg, rng)
        report.count(res)
        v = res.violation
        if v is not None and want is not None and not want(v):
            report.passed_over.append((ep, v))
        elif v is not None:
            report.seconds = time.monotonic() - t0
            report.failure, report.failed_episode, report.calls_to_find = res, ep, report.calls
            if log:
                log(f"episode {ep} failed after {res.calls} calls: {v}; shrinking")
            report.shrunk = shrink(cfg, res.steps, v, shrink_s) if shrink_s > 0 else res.steps
            return report
        ep += 1
    report.seconds = time.monotonic() - t0
    return report


def format_steps(steps: list[Step]) -> str:
    return "[\n" + "".join(f"    {step!r},\n" for step in steps) + "]"


def reproduction(report: FuzzReport) -> str:
    res = report.failure
    assert res is not None and res.violation is not None
    steps = report.shrunk if report.shrunk is not None else res.steps
    cfg_fields = ", ".join(f"{f.name}={getattr(res.cfg, f.name)!r}" for f in fields(res.cfg))
    return (
        f"{res.violation}\n"
        f"replay: {'HICACHE_FUZZ_PEER=1 ' if res.cfg.storage == 'peer' else ''}"
        f"HICACHE_FUZZ_SEED={report.seed} HICACHE_FUZZ_EPISODE={report.failed_episode} "
        f".venv/bin/python -m pytest tests/fuzz -k replay -q -p no:cacheprovider\n"
        f"shrunk to {len(steps)} of {len(res.steps)} steps (deterministic: {res.cfg.deterministic}):\n\n"
        f"from tests.fuzz.harness import FuzzConfig, replay_steps\n"
        f"cfg = FuzzConfig({cfg_fields})\n"
        f"steps = {format_steps(steps)}\n"
        f"print(replay_steps(cfg, steps))\n")


def replay_steps(cfg: FuzzConfig, steps: list[Step]) -> Violation | None:
    """Run recorded steps on a fresh runtime; the violation they hit, if any."""
    return run_episode(cfg, random.Random(0), steps).violation


def hybrid_only(cfg: FuzzConfig) -> bool:
    """`fuzz(only=...)` for the episodes with recurrent state."""
    return cfg.hybrid


def sliding_only(cfg: FuzzConfig) -> bool:
    """`fuzz(only=...)` for the episodes with sliding-window layers."""
    return cfg.sliding


def env_only() -> Callable[[FuzzConfig], bool] | None:
    """`HICACHE_FUZZ_HYBRID=1`: only the episodes with recurrent state."""
    return hybrid_only if os.environ.get("HICACHE_FUZZ_HYBRID") not in (None, "", "0") else None


def env_episodes() -> Callable[[int, int], tuple[FuzzConfig, random.Random]]:
    """`HICACHE_FUZZ_PEER=1`: the peer episodes' stream (`peer_episode`)."""
    return peer_episode if os.environ.get("HICACHE_FUZZ_PEER") not in (None, "", "0") else generate_episode


def env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def signature(v: Violation) -> str:
    """A violation with its numbers blanked: episodes that hit the same bug share it."""
    import re

    detail = re.sub(r"^(after )?step\(\[.*?\]\)(:| item)? ", "", v.detail)  # a batch (item) as the call itself
    return f"{v.kind}: {re.sub(r'[0-9]+', 'N', detail)[:100]}"


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.fuzz.harness --seed S --calls N [--all]`: fuzz, print the figures and a
    shrunk reproduction of the first violation (of each distinct one with `--all`)."""
    import argparse

    from runtime.trace import configure_logging

    ap = argparse.ArgumentParser(description="model-based fuzzer of the CacheRuntime API")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--first-episode", type=int, default=0)
    ap.add_argument("--shrink-s", type=float, default=60.0)
    ap.add_argument("--all", action="store_true", help="keep going past violations; report each distinct one")
    ap.add_argument("--hybrid", action="store_true", help="only the episodes with recurrent state")
    ap.add_argument("--sliding", action="store_true", help="only the episodes with sliding-window layers")
    ap.add_argument("--peer", action="store_true", help="the peer episodes (a decode runtime on a fake prefill peer)")
    args = ap.parse_args(argv)
    only = hybrid_only if args.hybrid else sliding_only if args.sliding else None
    episodes = peer_episode if args.peer else generate_episode
    configure_logging()
    seen: dict[str, tuple[int, Violation]] = {}

    def new_kind(v: Violation) -> bool:
        return signature(v) not in seen

    report = fuzz(args.seed, args.calls, first_episode=args.first_episode, shrink_s=0,
                  want=(lambda v: False) if args.all else None, only=only, episodes=episodes)
    print(report.summary())
    found = [(ep, v) for ep, v in report.passed_over]
    if report.failure is not None and report.failure.violation is not None:
        found.append((report.failed_episode or 0, report.failure.violation))
    for ep, v in found:
        if new_kind(v):
            seen[signature(v)] = (ep, v)
    for sig, (ep, v) in seen.items():
        n = sum(1 for _, w in found if signature(w) == sig)
        sub = fuzz(args.seed, 1, first_episode=ep, shrink_s=args.shrink_s, episodes=episodes)
        print(f"\n=== {n} episode(s): {sig}")
        print(reproduction(sub) if sub.failure is not None else f"episode {ep} did not fail again (not deterministic)")
    return 1 if seen else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
