"""Storage-tier throughput through the runtime, against raw baselines on the same bytes.

Shapes (``--shapes``, default all three): ``smollm2``, SmolLM2-135M (30 layers, 3 KV heads, head dim
64, bf16, K and V: 1,474,560 bytes per 64-token page), ``deepseek-v3``, DeepSeek-V3's MLA cache (61
layers, one latent of 512 + 64 per token, bf16: 4,497,408 bytes per page) and ``bamba-9b``, a hybrid
model: the KV of Bamba-9B's 3 attention layers (786,432 bytes per page) and the snapshot of its
recurrent state after the request's last page (29 Mamba2 layers, 123,594,752 bytes, written and read
as 158 page-sized chunks beside the pages: docs/STORAGE.md, "State snapshots"); 64-token pages, host
pool page_first, CPU copy engine. Every row names its shape; a hybrid row's bytes and its baseline's
are the pages' and the state chunks'.

Candidate (per backend), one `CacheRuntime.open(config, storage=backend)` per run:

- **write**: a request of ``pages * 64 + 1`` tokens is admitted, its KV written (fingerprints),
  then ``finish`` backs it up to host and the tree writes it through to storage. Timed from
  the first ``set_batch`` call (the host backup has acked) until the runtime has applied the
  storage ack (no storage op left in the tree actor). ``e2e_write`` also reports
  ``finish`` -> storage ack, host backup included.
- **read**: after ``flush()`` (device and host empty), ``admit`` of the same tokens with the
  ``wait_complete`` policy: page hashes, host pages for the read, one read of the leading
  present pages straight into the (page_first) host pool pages (``get_prefix``; for Mooncake
  ``batch_get_into`` into the pool, which the runtime registers), ack into the tree, then the
  admit itself. Timed from the ``admit`` call until it returns (the host -> device load has
  been issued, not waited for). Fingerprints are checked afterwards.

Baselines, measured in the same process and run on the same page bytes, interleaved with the
candidate (order alternates per repeat), median of ``--repeats`` (>= 5):

- file: one file per page written to a temporary name and renamed, same fsync policy as the
  backend, read back with ``readinto`` into a preallocated buffer (page cache warm for both).
- mooncake: the raw ``MooncakeDistributedStore`` client's ``batch_put_from`` /
  ``batch_get_into`` from/to registered memory, batches of ``--batch`` pages. The Mooncake
  part runs in a child process inside a private network namespace (Mooncake clients listen on
  every interface), launched like the tests' `netns_run`, with a local cluster.

Page integrity (``--integrity``, default ``on``; a comma list runs each mode in turn, one runtime
each, every mode with its own same-run baseline): ``on`` is the runtime as shipped (unkeyed XXH3-128
tags computed and checked by the storage tier), ``keyed`` sets ``storage_key`` (BLAKE3 keyed MACs),
``off`` replaces the runtime's `PageSeal` by one that computes nothing and accepts every page (the
bench's stand-in for an unchecked path: backends still store and return the tags). The ``vs off``
column divides a mode's baseline ratio by the ``off`` mode's (target for ``on``: >= 0.8).

Targets: file >= 0.8x its baseline, Mooncake >= 0.9x. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import BAMBA_9B, DEEPSEEK_V3_MLA, emit_json, git_commit, median  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.fingerprint import write_fingerprints  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.file_backend import FileBackend  # noqa: E402
from runtime.storage.integrity import TAG_BYTES, PageSeal  # noqa: E402
from runtime.storage.hashing import KVIdentity, page_hashes  # noqa: E402
from runtime.storage.state_blobs import StateBlobFormat  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

PS = 64
# the KV identity and shape fields of each measured model (RuntimeConfig fields)
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": {"model_id": "HuggingFaceTB/SmolLM2-135M", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
                "kv_dtype": "bfloat16"},
    "deepseek-v3": DEEPSEEK_V3_MLA,
    "bamba-9b": BAMBA_9B,
}
TARGETS = {"file": 0.8, "mooncake": 0.9}


INTEGRITY_MODES = ("off", "on", "keyed")
BENCH_KEY = "bench-storage key, not a secret"


class NoCheck(PageSeal):
    """The ``off`` mode's seal: no tag computed (zeros), every page accepted."""

    def tag(self, key: bytes, payload: object) -> bytes:
        return bytes(TAG_BYTES)

    def check(self, key: bytes, payload: object, tag: object) -> bool:
        return True


def integrity_mode(mode: str) -> None:
    """Make the runtimes opened from here on use `mode`'s seal (``keyed``: via the config)."""
    import runtime.assembly as rt_module

    rt_module.PageSeal = NoCheck if mode == "off" else PageSeal


def make_config(pages: int, shape: str, mode: str = "on") -> RuntimeConfig:
    tokens = pages * PS
    hybrid = {"state_slots": 2} if "state_layers" in SHAPES[shape] else {}  # a running slot and the snapshot
    return RuntimeConfig(**SHAPES[shape], page_size=PS,
                         device_slots=tokens + 2 * PS, host_tokens=2 * tokens + 4 * PS, host_layout="page_first",
                         write_policy="write_through", copy_engine="cpu", prefetch_policy="wait_complete",
                         storage_key=BENCH_KEY if mode == "keyed" else None, **hybrid)


def state_format(config: RuntimeConfig) -> StateBlobFormat | None:
    """A hybrid shape's state snapshot as storage holds it (None: no recurrent state)."""
    shape = config.state_shape
    return StateBlobFormat.of(shape, PS * config.bytes_per_token) if shape is not None else None


def op_rows(pages: int, shape: str) -> int:
    """Backend pages one op moves: the KV pages, and a hybrid shape's state chunks."""
    fmt = state_format(make_config(1, shape))
    return pages + (fmt.chunks if fmt is not None else 0)


def page_bytes(shape: str) -> int:
    return PS * make_config(1, shape).bytes_per_token


def describe(shape: str) -> str:
    f = SHAPES[shape]
    kv = "one latent" if f.get("kv_layout") == "mla" else f"{f['num_kv_heads']} KV heads"
    fmt = state_format(make_config(1, shape))
    state = (f"; a state snapshot of {f['state_layers']} recurrent layers, {fmt.state_bytes} B in {fmt.chunks} chunks"
             if fmt is not None else "")
    return f"{f['model_id']} ({f['num_layers']} layers, {kv}, head dim {f['head_dim']}, {f['kv_dtype']}{state})"


class Probe:
    """Pass-through backend that records when the runtime first calls set_batch / a read call
    (exists_prefix, get_prefix or get_batch) and when the last write / read call returns. It offers
    exactly the optional capabilities of the backend it wraps (get_prefix, exists_is_local)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.t_set: float | None = None
        self.t_exists: float | None = None  # first read-side call of the op
        self.t_set_end = self.t_get_end = 0.0
        self.active = 0  # backend write calls running now (in worker threads)
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by Candidate
        self.idle: asyncio.Event | None = None  # set (from the worker) when `active` drops to 0
        self.exists_is_local = getattr(inner, "exists_is_local", False)
        if getattr(inner, "get_prefix", None) is None:
            self.get_prefix = None

    @property
    def page_bytes(self) -> int:
        return self.inner.page_bytes

    def _read_started(self) -> None:
        if self.t_exists is None:
            self.t_exists = time.perf_counter()

    def exists_prefix(self, keys):
        self._read_started()
        return self.inner.exists_prefix(keys)

    def _read(self, call, keys, dests, tags):
        self._read_started()
        try:
            return call(keys, dests, tags)
        finally:
            self.t_get_end = time.perf_counter()

    def get_prefix(self, keys, dests, tags=None):
        return self._read(self.inner.get_prefix, keys, dests, tags)

    def get_batch(self, keys, dests, tags=None):
        return self._read(self.inner.get_batch, keys, dests, tags)

    def set_batch(self, keys, srcs, tags=None):
        if self.t_set is None:
            self.t_set = time.perf_counter()
        with self._lock:
            self.active += 1
        try:
            return self.inner.set_batch(keys, srcs, tags)
        finally:
            self.t_set_end = time.perf_counter()
            with self._lock:
                self.active -= 1
                if self.active == 0 and self.loop is not None and self.idle is not None:
                    self.loop.call_soon_threadsafe(self.idle.set)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict:
        return self.inner.stats()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_tokens(pages: int, run: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + run)
    return rng.integers(0, 49152, pages * PS + 1, dtype=np.int32)


class Candidate:
    """One runtime over a storage backend; `prepare` fills the device, `write`/`read` are timed."""

    def __init__(self, rt: CacheRuntime, probe: Probe, pages: int) -> None:
        self.rt, self.probe, self.pages = rt, probe, pages
        self.n = pages * PS
        self.page_bytes = PS * rt.config.bytes_per_token
        self.state = state_format(rt.config)  # a hybrid shape's snapshot after the last page
        probe.loop, probe.idle = asyncio.get_running_loop(), asyncio.Event()

    async def prepare(self, tokens: np.ndarray, rid: str) -> torch.Tensor:
        """Admit and write the KV (and a hybrid shape's snapshot at the last page: random bytes);
        return the canonical page bytes ``[pages (+ state chunks), page_bytes]`` (the baseline's source)."""
        res = await self.rt.admit(rid, tokens)
        assert res.cached == 0, res.cached
        write_fingerprints(self.rt.device_pool, np.asarray(res.slots), tokens)
        kv = self.rt.device_pool.read_slots(np.asarray(res.slots[: self.n]))  # [L, C, n, H, D]
        chunks = self.state.chunks if self.state is not None else 0
        src = torch.empty((self.pages + chunks, self.page_bytes), dtype=torch.uint8)
        for i in range(self.pages):
            src[i].copy_(kv[:, :, i * PS:(i + 1) * PS].contiguous().view(torch.uint8).reshape(-1))
        if self.state is not None:
            blob = torch.randint(0, 256, (self.state.state_bytes,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(int(tokens[0])))
            self.rt.state_pool.write_slot(await self.rt.snapshot(rid, self.n), blob)
            src[self.pages:].copy_(torch.from_numpy(np.stack(self.state.split(blob.numpy()))))
        return src

    async def _no_storage_op(self) -> None:
        """Until no copy and no storage op is left in the tree actor. While a backend write call
        runs, sleeps until it returns (woken from the worker; a busy poll would compete with it for
        the GIL); then polls each loop turn, so the end is seen within a tree round trip of the ack
        (a plain 2 ms poll added up to 2 ms, ~1 ms on average, to a ~4 ms write of 32 pages)."""
        probe = self.probe
        while await self.rt.inspect(lambda core: not core.quiet()):
            probe.idle.clear()
            if probe.active:
                await probe.idle.wait()
            else:
                await asyncio.sleep(0)

    async def write(self, tokens: np.ndarray, rid: str) -> tuple[float, float, float]:
        """(storage part, finish -> storage ack, backend calls alone) seconds."""
        st = await self.rt.stats()
        before, states_before = st["storage"]["written_pages"], st["state"]["storage_writes"]
        self.probe.t_set = None
        t0 = time.perf_counter()
        await self.rt.finish(rid, tokens[: self.n])
        while self.probe.t_set is None:
            await asyncio.sleep(0.002)  # coarse: a busy poll would compete with the worker for the GIL
        await self._no_storage_op()
        t1 = time.perf_counter()
        st = await self.rt.stats()
        assert st["storage"]["written_pages"] - before == self.pages, (st["storage"]["written_pages"], before)
        assert st["state"]["storage_writes"] - states_before == (self.state is not None), st["state"]
        return t1 - self.probe.t_set, t1 - t0, self.probe.t_set_end - self.probe.t_set

    async def read(self, tokens: np.ndarray, rid: str, src: torch.Tensor) -> tuple[float, float]:
        """(admit call -> admit returns, first read-side backend call -> last one returns) seconds."""
        await self.rt.flush()
        assert await self.rt.match_prefix(tokens) == {"device": 0, "host": 0}
        before = (await self.rt.stats())["storage"]["hit_tokens"]
        self.probe.t_exists = None
        t0 = time.perf_counter()
        res = await self.rt.admit(rid, tokens)
        t1 = time.perf_counter()
        assert res.cached == self.n, res.cached
        for r in res.readiness:
            await r.wait_all()
        await self._no_storage_op()
        assert (await self.rt.stats())["storage"]["hit_tokens"] - before == self.n
        kv = self.rt.device_pool.read_slots(np.asarray(res.slots[: self.n]))  # bf16 fingerprints are lossy:
        for i in range(self.pages):  # compare with the bytes written instead
            page = kv[:, :, i * PS:(i + 1) * PS].contiguous().view(torch.uint8).reshape(-1)
            assert torch.equal(page, src[i]), f'page {i} read back wrong'
        if self.state is not None:  # the hit resumes from the snapshot read with the pages
            assert res.state_from is not None
            want = src[self.pages:].reshape(-1)[:self.state.state_bytes]
            assert torch.equal(self.rt.state_pool.read_slot(res.state_from), want), "state read back wrong"
        await self.rt.abort(rid)
        await self.rt.flush()
        return t1 - t0, self.probe.t_get_end - self.probe.t_exists

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        """The op's backend keys: its pages', then a hybrid shape's state chunks'."""
        keys = page_hashes(tokens[: self.n], PS, None, KVIdentity.from_config(self.rt.config))
        return keys + list(self.state.keys(keys[-1])) if self.state is not None else keys


def ordered(run: int, a, b):
    return (a, b) if run % 2 == 0 else (b, a)


def new_results() -> dict[str, list[float]]:
    return {k: [] for k in ("cand_w", "cand_e2e_w", "cand_call_w", "base_w", "cand_r", "cand_call_r", "base_r")}


async def timed_round(res: dict[str, list[float]], cand: Candidate, run: int, tokens: np.ndarray, src: torch.Tensor,
                      dst: torch.Tensor, base_w: Callable[[], float], base_r: Callable[[], float],
                      before_write: Callable[[], None] | None = None) -> None:
    """One round: candidate and baseline writes, then reads, in the order of `ordered`; the
    baseline's read must land the source bytes in `dst`. Run 0 (warm-up) is not recorded."""
    times: dict[str, float] = {}
    for who in ordered(run, "cand", "base"):
        if before_write is not None:
            before_write()
        if who == "cand":
            times["cand_w"], times["cand_e2e_w"], times["cand_call_w"] = await cand.write(tokens, f"w{run}")
        else:
            times["base_w"] = base_w()
    for who in ordered(run, "cand", "base"):
        if who == "cand":
            times["cand_r"], times["cand_call_r"] = await cand.read(tokens, f"r{run}", src)
        else:
            times["base_r"] = base_r()
    assert torch.equal(dst, src)
    if run > 0:
        for k, v in times.items():
            res[k].append(v)


# -- file ------------------------------------------------------------------------------------


async def file_runs(pages: int, repeats: int, fsync: str, base_dir: str, shape: str,
                    modes: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per integrity mode, its results: one runtime (and directory) per mode, all open at once, the
    modes taking turns within each round (order rotating), each next to its own baseline run."""
    out = {mode: new_results() for mode in modes}
    pb, rows = page_bytes(shape), op_rows(pages, shape)  # (rows: the pages and a hybrid shape's state chunks)
    root = tempfile.mkdtemp(prefix="bench-storage-", dir=base_dir)
    try:
        bdir = os.path.join(root, "baseline")
        os.makedirs(bdir)
        dst = torch.empty((rows, pb), dtype=torch.uint8)
        dst.fill_(1)  # pre-touched, like a host pool
        async with contextlib.AsyncExitStack() as stack:
            cands: dict[str, Candidate] = {}
            for mode in modes:
                fb = FileBackend(os.path.join(root, f"fb-{mode}"), pb, fsync=fsync)
                stack.callback(fb.close)
                probe = Probe(fb)
                integrity_mode(mode)  # (the seal is made as the runtime opens)
                rt = await stack.enter_async_context(CacheRuntime.open(make_config(pages, shape, mode), storage=probe))
                cands[mode] = Candidate(rt, probe, pages)
            for run in range(repeats + 1):  # run 0 warms up (allocator, page cache, threads); not counted
                tokens = run_tokens(pages, run)
                for mode in rotated(modes, run):
                    cand = cands[mode]
                    src = await cand.prepare(tokens, f"w{run}")
                    keys = cand.keys(tokens)
                    sv, dv = src.numpy(), dst.numpy()

                    def base_w() -> float:
                        t = time.perf_counter()
                        for i in range(rows):
                            final = os.path.join(bdir, keys[i].hex())
                            tmp = final + ".tmp"
                            with open(tmp, "wb", buffering=0) as f:
                                f.write(memoryview(sv[i]))
                                if fsync != "none":
                                    os.fsync(f.fileno())
                            os.rename(tmp, final)
                        if fsync == "dir":
                            dfd = os.open(bdir, os.O_RDONLY)
                            os.fsync(dfd)
                            os.close(dfd)
                        return time.perf_counter() - t

                    def base_r() -> float:
                        t = time.perf_counter()
                        for i in range(rows):
                            with open(os.path.join(bdir, keys[i].hex()), "rb", buffering=0) as f:
                                f.readinto(memoryview(dv[i]))
                        return time.perf_counter() - t

                    await timed_round(out[mode], cand, run, tokens, src, dst, base_w, base_r, before_write=os.sync)
                    fb = cand.probe.inner
                    for k in keys:
                        os.unlink(os.path.join(bdir, k.hex()))
                        os.unlink(fb._path(k)[2])
                    fb.cleanup()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def rotated(modes: list[str], run: int) -> list[str]:
    k = run % len(modes)
    return modes[k:] + modes[:k]


# -- mooncake (child process, private network namespace) -------------------------------------


async def mooncake_runs(pages: int, repeats: int, batch: int, shape: str,
                        modes: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per integrity mode, its results: one runtime per mode over one backend (each mode's own
    tokens, so its own keys), the modes taking turns within each round as in `file_runs`."""
    from runtime.storage.mooncake_backend import TAG_SUFFIX, MooncakeBackend
    from runtime.storage.mooncake_cluster import LocalMooncakeCluster

    out = {mode: new_results() for mode in modes}
    pb, rows = page_bytes(shape), op_rows(pages, shape)  # (rows: the pages and a hybrid shape's state chunks)
    seg = max(1 << 30, 4 * rows * pb + (256 << 20))
    with LocalMooncakeCluster() as cl:
        mb = MooncakeBackend(pb, cl.config(global_segment_size=seg, local_buffer_size=max(256 << 20, batch * pb * 2)),
                             staging_bytes=batch * pb)
        st = mb._store
        src_reg = torch.empty((rows, pb), dtype=torch.uint8)
        dst = torch.ones((rows, pb), dtype=torch.uint8)
        mb.register_buffer(src_reg)
        mb.register_buffer(dst)
        sp, dp = src_reg.data_ptr(), dst.data_ptr()
        # warm the segment: fill it once and remove everything (cold segment memory is ~20x slower)
        wk = [f"warm/{i}" for i in range(seg // pb - 8)]
        for s0 in range(0, len(wk), batch):
            ks = wk[s0:s0 + batch]
            st.batch_put_from(ks, [sp + (i % rows) * pb for i in range(len(ks))], [pb] * len(ks))
        for k in wk:
            st.remove(k, True)
        async with contextlib.AsyncExitStack() as stack:
            cands: dict[str, Candidate] = {}
            for mode in modes:
                probe = Probe(mb)
                integrity_mode(mode)  # (the seal is made as the runtime opens)
                rt = await stack.enter_async_context(CacheRuntime.open(make_config(pages, shape, mode), storage=probe))
                cands[mode] = Candidate(rt, probe, pages)
            # each runtime registers its page_first host pool with the backend itself (zero-copy I/O)
            assert mb.stats()["registered_buffers"] == 2 + len(modes), mb.stats()["registered_buffers"]
            for run in range(repeats + 1):
                for mode in rotated(modes, run):
                    cand = cands[mode]
                    tokens = run_tokens(pages, run + 1000 * modes.index(mode))
                    src = await cand.prepare(tokens, f"w{run}")
                    src_reg.copy_(src)
                    keys = cand.keys(tokens)
                    raw_keys = [f"bench-raw/{k.hex()}" for k in keys]

                    def base_w() -> float:
                        t = time.perf_counter()
                        for s0 in range(0, rows, batch):
                            n = min(batch, rows - s0)
                            r = st.batch_put_from(raw_keys[s0:s0 + n], [sp + (s0 + i) * pb for i in range(n)],
                                                  [pb] * n)
                            assert all(x == 0 for x in r), r
                        return time.perf_counter() - t

                    def base_r() -> float:
                        t = time.perf_counter()
                        for s0 in range(0, rows, batch):
                            n = min(batch, rows - s0)
                            r = st.batch_get_into(raw_keys[s0:s0 + n], [dp + (s0 + i) * pb for i in range(n)],
                                                  [pb] * n)
                            assert all(x == pb for x in r), r
                        return time.perf_counter() - t

                    await timed_round(out[mode], cand, run, tokens, src, dst, base_w, base_r)
                    time.sleep(cl.lease_ttl_ms / 1000 + 0.1)  # read leases expire, then free the space
                    for k in mb._keys(keys) + [k + TAG_SUFFIX for k in mb._keys(keys)] + raw_keys:
                        st.remove(k, True)
        mb.close()
    return out


def mooncake_in_netns(args: argparse.Namespace, shape: str,
                      modes: list[str]) -> tuple[dict[str, dict[str, list[float]]] | None, str]:
    """Run the Mooncake part in a child inside a private network namespace; (results, note)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return None, "mooncake not installed (scripts/install_mooncake.sh)"
    from tests.netns import netns_argv

    argv = netns_argv([sys.executable, os.path.abspath(__file__), "--mooncake-child",
            "--pages", str(args.pages), "--repeats", str(args.repeats), "--batch", str(args.batch), "--shapes", shape,
            "--integrity", ",".join(modes)])
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=args.mooncake_timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"mooncake child timed out after {args.mooncake_timeout}s"
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return None, f"mooncake child failed (rc {p.returncode}): " + " | ".join(tail)
    return json.loads(p.stdout.strip().splitlines()[-1]), ""


# -- report ----------------------------------------------------------------------------------


def summarize(res: dict[str, list[float]], pages: int, shape: str) -> dict[str, Any]:
    gib = op_rows(pages, shape) * page_bytes(shape) / 2**30
    out: dict[str, Any] = {}
    for op, c, b in (("write", "cand_w", "base_w"), ("read", "cand_r", "base_r")):
        mc, mb = median(res[c]), median(res[b])
        out[op] = {"candidate_GiBps": round(gib / mc, 3), "baseline_GiBps": round(gib / mb, 3),
                   "ratio": round(mb / mc, 3), "candidate_ms": round(mc * 1e3, 2), "baseline_ms": round(mb * 1e3, 2)}
    out["write_e2e_GiBps"] = round(gib / median(res["cand_e2e_w"]), 3)
    out["backend_call_GiBps"] = {"write": round(gib / median(res["cand_call_w"]), 3),
                                 "read": round(gib / median(res["cand_call_r"]), 3)}
    return out


def hash_cost(pages: int, repeats: int) -> dict[str, float]:
    """Page-hash cost (the tree computes a chain per write and per lookup): µs per page, median."""
    ident = KVIdentity.from_config(make_config(pages, "smollm2"))
    tokens = np.random.default_rng(0).integers(0, 50000, pages * PS, dtype=np.int32)
    out = {}
    for ps in (16, PS):
        times = []
        for _ in range(max(repeats, 5)):
            t0 = time.perf_counter()
            page_hashes(tokens, ps, None, ident)
            times.append(time.perf_counter() - t0)
        out[f"us_per_page_{ps}"] = round(median(times) / (len(tokens) // ps) * 1e6, 3)
    return out


def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 pages, 5 repeats")
    ap.add_argument("--pages", type=int, default=128, help="64-token pages per request (default 128 = 180 MiB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=32, help="raw Mooncake baseline batch size (pages)")
    ap.add_argument("--fsync", default="none", choices=("none", "file", "dir"))
    ap.add_argument("--backends", default="file,mooncake")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"models measured, from {', '.join(SHAPES)}")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the file backend and baseline write")
    ap.add_argument("--mooncake-timeout", type=int, default=400)
    ap.add_argument("--integrity", default="on",
                    help=f"page integrity modes, a comma list from {', '.join(INTEGRITY_MODES)} (default on)")
    ap.add_argument("--mooncake-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    modes = [m.strip() for m in args.integrity.split(",") if m.strip()]
    if not modes or any(m not in INTEGRITY_MODES for m in modes):
        ap.error(f"--integrity takes modes from {', '.join(INTEGRITY_MODES)}, got {args.integrity!r}")
    if args.quick:
        args.pages, args.repeats = 32, 5
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
    if not shapes or any(name not in SHAPES for name in shapes):
        ap.error(f"--shapes takes names from {', '.join(SHAPES)}, got {args.shapes!r}")
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    if args.mooncake_child:
        print(json.dumps(run(mooncake_runs(args.pages, args.repeats, args.batch, shapes[0], modes))))
        return

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results: dict[str, dict[str, Any]] = {shape: {} for shape in shapes}
    notes: dict[str, str] = {}
    for shape in shapes:  # results[shape][backend, or "backend/mode" past the first mode]
        def name(be: str, mode: str) -> str:
            return be if len(modes) == 1 else f"{be}/{mode}"

        if "file" in backends:
            by_mode = run(file_runs(args.pages, args.repeats, args.fsync, args.dir, shape, modes))
            for mode in modes:
                results[shape][name("file", mode)] = summarize(by_mode[mode], args.pages, shape)
        if "mooncake" in backends:
            by_mode, note = mooncake_in_netns(args, shape, modes)
            if by_mode is None:
                notes["mooncake"] = note
            else:
                for mode in modes:
                    results[shape][name("mooncake", mode)] = summarize(by_mode[mode], args.pages, shape)
        if "off" in modes and len(modes) > 1:  # each mode's baseline ratio over the off mode's
            for key, r in results[shape].items():
                be = key.split("/")[0]
                off = results[shape].get(f"{be}/off")
                if off is not None:
                    for op in ("write", "read"):
                        r[op]["vs_off"] = round(r[op]["ratio"] / off[op]["ratio"], 3)

    print(f"storage throughput through the runtime: {PS}-token pages, {args.pages} pages per op, median of "
          f"{args.repeats}, fsync={args.fsync}, commit {git_commit()}")
    for shape in shapes:
        print(f"{shape}: {describe(shape)}, {page_bytes(shape)} B a page, "
              f"{op_rows(args.pages, shape) * page_bytes(shape) / 2**20:.0f} MiB per op")
    print(f"{'shape':<11} {'backend':<15} {'op':<6} {'runtime GiB/s':>14} {'baseline GiB/s':>15} {'ratio':>6} "
          f"{'target':>7} met {'vs off':>7}")
    for shape in shapes:
        for key, r in results[shape].items():
            be = key.split("/")[0]
            for op in ("write", "read"):
                x = r[op]
                vs_off = f"{x['vs_off']:>7.2f}" if "vs_off" in x else f"{'':>7}"
                print(f"{shape:<11} {key:<15} {op:<6} {x['candidate_GiBps']:>14.2f} {x['baseline_GiBps']:>15.2f} "
                      f"{x['ratio']:>6.2f} {TARGETS[be]:>7.1f} {'yes' if x['ratio'] >= TARGETS[be] else 'NO ':<3} {vs_off}")
    for shape in shapes:
        for be, r in results[shape].items():
            print(f"{shape} {be}: write incl. host backup (finish -> storage ack): {r['write_e2e_GiBps']:.2f} GiB/s; "
                  f"backend calls alone: write {r['backend_call_GiBps']['write']:.2f}, "
                  f"read (first call -> last returns) {r['backend_call_GiBps']['read']:.2f} GiB/s")
    for be, note in notes.items():
        print(f"{be}: skipped: {note}")
    hashing = hash_cost(args.pages, args.repeats)
    print(f"page hashes (chained SHA-256 over {args.pages * PS} tokens): {hashing[f'us_per_page_{PS}']:.2f} µs per "
          f"{PS}-token page, {hashing['us_per_page_16']:.2f} µs per 16-token page")
    emit_json({"benchmark": "bench_storage", "model_shapes": {shape: SHAPES[shape] for shape in shapes},
               "page_size": PS, "page_bytes": {shape: page_bytes(shape) for shape in shapes}, "pages": args.pages,
               "repeats": args.repeats, "fsync": args.fsync, "integrity": modes, "results": results, "targets": TARGETS,
               "skipped": notes, "page_hash_cost": hashing,
               "met": {shape: {key: all(r[op]["ratio"] >= TARGETS[key.split("/")[0]] for op in ("write", "read"))
                               for key, r in results[shape].items()} for shape in shapes}})


if __name__ == "__main__":
    main()
