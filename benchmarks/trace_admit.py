"""The admit path, traced: what one `admit` of a cached prefix runs inside `runtime/`.

`sys.setprofile` on the loop thread records every Python call into a module under `runtime/`
from the caller's `rt.admit(...)` until the load lands (every readiness of the result done and
the load's ack applied by the tree actor: no copy or storage op in flight). It counts the calls,
the files they are in, the file-to-file transitions (two successive calls in different files),
the messages sent (every mailbox send), and the tree and transfer actors' turns (bursts).
Worker threads (copy engine, storage calls) are not traced: the path is the loop thread's.

Two hits, each on a fresh runtime (CPU copy engine, no invariant checker):
- host: the prompt's KV lives on host only (its device copy evicted by another request);
- storage: on the file backend only (host and device flushed), `prefetch_policy="wait_complete"`,
  no `prepare` (the admit's lookup, read and load).

    .venv/bin/python benchmarks/trace_admit.py [--calls]     # --calls: print the traced calls

Last stdout line: one JSON object. A structural measure (counts, not times):
`tests/unit/actors/test_admit_path.py` asserts its bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import runtime  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.file_backend import FileBackend  # noqa: E402

RUNTIME_DIR = str(Path(runtime.__file__).resolve().parent) + "/"
N = 40  # tokens of the cached prefix (10 pages of 4)


@dataclass
class AdmitTrace:
    """What the loop thread ran in `runtime/` for one admit, call by call."""

    calls: list[tuple[str, str]] = field(default_factory=list)  # (file relative to runtime/, function)
    messages: list[str] = field(default_factory=list)  # the type of every message sent, in order
    turns: dict[str, int] = field(default_factory=lambda: {"tree": 0, "transfer": 0, "offload": 0})
    cached: int = 0  # tokens the admit found cached (the hit the trace is about)

    @property
    def files(self) -> int:
        return len({f for f, _ in self.calls})

    @property
    def transitions(self) -> int:
        return sum(1 for (a, _), (b, _) in zip(self.calls, self.calls[1:]) if a != b)

    def summary(self) -> dict[str, Any]:
        return {"calls": len(self.calls), "files": self.files, "transitions": self.transitions,
                "messages": len(self.messages), "tree_turns": self.turns["tree"],
                "transfer_turns": self.turns["transfer"], "cached": self.cached,
                "message_types": self.messages}


class _Profiler:
    def __init__(self, trace: AdmitTrace, rt: CacheRuntime) -> None:
        self.trace = trace
        self.owners = {id(rt._tree.mailbox): "tree", id(rt._transfer.mailbox): "transfer"}
        if rt._offload is not None:
            self.owners[id(rt._offload.mailbox)] = "offload"

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(RUNTIME_DIR):
            return
        name = code.co_name
        rel = path[len(RUNTIME_DIR):]
        if event == "call":
            self.trace.calls.append((rel, name))
            if name == "put_internal" and rel == "actors/base.py":
                self.trace.messages.append(type(frame.f_locals["msg"]).__name__)
        elif event == "return" and name in ("get_burst", "take_burst") and type(arg) is list and arg:
            # a burst received (a coroutine's "return" event at each suspension carries None)
            actor = self.owners.get(id(frame.f_locals["self"]))
            if actor is not None:
                self.trace.turns[actor] += 1


def _config(**changes: Any) -> RuntimeConfig:
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, device_slots=64, host_tokens=128,
                write_policy="write_through", copy_engine="cpu", debug_invariants=False)
    base.update(changes)
    return RuntimeConfig(**base)


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, N + 1, dtype=np.int64).astype(np.int32)


async def _settle(rt: CacheRuntime) -> None:
    while rt._core.in_flight():  # (read directly: an inspect would be traced)
        await asyncio.sleep(0.001)


async def _serve(rt: CacheRuntime, rid: str, tokens: np.ndarray, keep: int = N) -> None:
    await rt.admit(rid, tokens)
    await rt.finish(rid, tokens[:keep])
    await _settle(rt)


async def _traced_admit(rt: CacheRuntime, rid: str, tokens: np.ndarray) -> AdmitTrace:
    trace = AdmitTrace()
    await asyncio.sleep(0)
    profiler = _Profiler(trace, rt)
    sys.setprofile(profiler)
    try:
        res = await rt.admit(rid, tokens)
        for r in res.readiness:
            await r.wait_all()
        while True:  # until the load's ack is applied (the check itself is not traced)
            sys.setprofile(None)
            busy = rt._core.in_flight()
            sys.setprofile(profiler)
            if not busy:
                break
            await asyncio.sleep(0)
    finally:
        sys.setprofile(None)
    trace.cached = res.cached
    await rt.abort(rid)
    return trace


async def trace_host_hit() -> AdmitTrace:
    """The prompt's first N tokens on host only: one host -> device load."""
    async with CacheRuntime.open(_config()) as rt:
        a, b = _tokens(1), _tokens(2)
        await _serve(rt, "a", a)
        # b's admit evicts a's device copy (16 device pages); a stays on host, and b keeps one page
        # cached, so that the traced admit finds its pages free (no eviction on the path)
        await _serve(rt, "b", b, keep=4)
        if await rt.match_prefix(a[:N]) != {"device": 0, "host": N}:
            raise AssertionError("the host hit's setup did not leave the prefix on host only")
        return await _traced_admit(rt, "a2", a)


async def trace_storage_hit() -> AdmitTrace:
    """The prompt's first N tokens in storage only (`wait_complete`): lookup, read, load."""
    config = _config(host_tokens=256, device_slots=256, prefetch_policy="wait_complete")
    with tempfile.TemporaryDirectory() as tmp:
        fb = FileBackend(tmp, config.page_size * config.bytes_per_token)
        try:
            async with CacheRuntime.open(config, storage=fb) as rt:
                a = _tokens(3)
                await _serve(rt, "a", a)
                await rt.flush()
                if await rt.match_prefix(a[:N]) != {"device": 0, "host": 0}:
                    raise AssertionError("the storage hit's setup left the prefix cached")
                return await _traced_admit(rt, "a2", a)
        finally:
            fb.close()


def trace_both() -> dict[str, AdmitTrace]:
    return {"host": asyncio.run(trace_host_hit()), "storage": asyncio.run(trace_storage_hit())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", action="store_true", help="print every traced call")
    args = ap.parse_args()
    import json

    traces = trace_both()
    for kind, trace in traces.items():
        if args.calls:
            print(f"-- {kind} hit")
            for f, name in trace.calls:
                print(f"{f}:{name}")
        s = trace.summary()
        print(f"{kind} hit: {s['calls']} calls, {s['files']} files, {s['transitions']} transitions, "
              f"{s['messages']} messages ({', '.join(s['message_types'])}), "
              f"{s['tree_turns']} tree + {s['transfer_turns']} transfer turns, {s['cached']} tokens cached")
    print(json.dumps({kind: t.summary() for kind, t in traces.items()}, sort_keys=True))


if __name__ == "__main__":
    main()
