"""Cache-aware routing across runtime instances, by their KV events.

N instances run as separate processes, each a `CacheRuntime` with a simulated forward (the time
a GPU would take: per computed token, per token loaded from host or storage) and one shared
storage directory (a file backend: the fleet's L3). Each publishes its KV events over ZMQ on
127.0.0.1. The router subscribes to all of them and keeps a `PrefixIndex` (which instance holds
which page hash on which medium); it sends each request to the instance with the longest cached
prefix (device > host > storage: a page costs nothing on device, a copy from host, a read from
storage), each request already queued there counting as `load_tokens` more to compute, among
the instances within `load_bound` requests of the least loaded one. Round robin
and random are the baselines (benchmarks/bench_fleet.py compares the three).

    .venv/bin/python examples/router.py            # 4 instances, a short multi-turn trace

Everything binds 127.0.0.1; the instances stop when the router closes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from runtime import CacheRuntime, RuntimeConfig  # noqa: E402
from runtime.errors import CapacityError  # noqa: E402
from runtime.events import PrefixIndex  # noqa: E402
from runtime.events.subscriber import ZmqEventSubscriber  # noqa: E402
from runtime.storage.hashing import KVIdentity, page_hashes  # noqa: E402

POLICIES = ("events", "round_robin", "random")


@dataclass(frozen=True)
class FleetConfig:
    """One instance's cache and the simulated forward's costs (seconds per token)."""

    page_size: int = 16
    device_tokens: int = 24576
    host_tokens: int = 24576
    write_policy: str = "write_through_selective"
    prefill_s_per_token: float = 20e-6  # a computed prompt token
    host_s_per_token: float = 1e-6  # a token loaded host -> device
    storage_s_per_token: float = 4e-6  # a token read from storage (then loaded from host)

    def runtime_config(self, storage_dir: str) -> RuntimeConfig:
        return RuntimeConfig(
            num_layers=1, num_kv_heads=1, head_dim=8, page_size=self.page_size, device_slots=self.device_tokens,
            host_tokens=self.host_tokens, write_policy=self.write_policy, copy_engine="cpu",
            storage_backend="file", storage_dir=storage_dir, prefetch_policy="wait_complete",
            kv_events=True, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")


class Result(msgspec.Struct):
    """What an instance reports for one request."""

    rid: str
    instance: int
    prompt_tokens: int
    device: int  # tokens found on device
    host: int  # tokens loaded from host (storage's included)
    storage: int  # of `host`: tokens the request's prefetch read from storage
    ttft_s: float  # arrival at the instance -> first token (queueing included)


# -- an instance (its own process) ------------------------------------------------------------
async def serve(index: int, fleet: FleetConfig, storage_dir: str) -> None:
    """Serve requests from the router until it says stop; print the endpoints first."""
    async with CacheRuntime.open(fleet.runtime_config(storage_dir)) as rt:
        # warm up (compiled page hashing, first copies) before taking requests: not in any TTFT
        warm = np.arange(4 * fleet.page_size, dtype=np.int32)
        await rt.admit("warm-up", warm, extra_key="warm-up")
        await rt.finish("warm-up", warm)
        await rt.flush()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind("tcp://127.0.0.1:*")
        pub, replay = rt.kv_events_endpoints
        print(json.dumps({"requests": sock.getsockopt_string(zmq.LAST_ENDPOINT), "events": pub, "replay": replay}),
              flush=True)
        gpu = asyncio.Lock()  # one forward at a time: requests queue for it
        tasks: set[asyncio.Task[None]] = set()
        decode = msgspec.msgpack.Decoder()
        encode = msgspec.msgpack.Encoder().encode

        async def handle(ident: bytes, req: dict[str, Any]) -> None:
            t0 = time.perf_counter()
            prompt = np.frombuffer(req["prompt"], dtype="<i4")
            full = np.concatenate((prompt, np.frombuffer(req["reply"], dtype="<i4")))
            rid = req["rid"]
            while True:  # slots for the prompt and the reply at once, or none: no request holds
                try:     # slots while it waits for more (that deadlocks a full pool)
                    res = await rt.admit(rid, prompt)
                except CapacityError:  # the pool is full of running requests: wait for one to end
                    await asyncio.sleep(0.002)
                    continue
                try:
                    await rt.extend(rid, len(full) - len(prompt))  # the reply's slots (decode)
                    break
                except CapacityError:
                    await rt.abort(rid)
                    await asyncio.sleep(0.002)
            for ready in res.readiness:
                await ready.wait_all()
            computed = len(prompt) - res.cached
            async with gpu:
                await asyncio.sleep(computed * fleet.prefill_s_per_token + res.loaded_host * fleet.host_s_per_token
                                    + res.loaded_storage * fleet.storage_s_per_token)
                ttft = time.perf_counter() - t0
            await rt.finish(rid, full)
            out = Result(rid, index, len(prompt), res.cached_device, res.loaded_host, res.loaded_storage, ttft)
            await sock.send_multipart((ident, b"", encode(out)))

        while True:
            ident, _, payload = await sock.recv_multipart()
            req = decode.decode(payload)
            if req.get("op") == "stop":
                await asyncio.gather(*tasks)
                await sock.send_multipart((ident, b"", b"stopped"))
                break
            task = asyncio.create_task(handle(ident, req))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sock.close(linger=1000)
        ctx.term()


# -- the router --------------------------------------------------------------------------------
@dataclass
class Instance:
    index: int
    proc: subprocess.Popen[str]
    requests: str
    events: str
    replay: str
    sock: Any = None
    inflight: int = 0
    pending: dict[str, asyncio.Future[Result]] = field(default_factory=dict)


class Router:
    """Starts `n` instances, follows their events, routes requests by `policy`."""

    def __init__(self, n: int, fleet: FleetConfig, storage_dir: str, *, policy: str = "events",
                 load_bound: int = 4, load_tokens: int = 256, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.n, self.fleet, self.storage_dir, self.policy = n, fleet, storage_dir, policy
        self.load_bound = load_bound  # never more than this many requests above the least loaded
        self.load_tokens = load_tokens  # what a request already there costs a new one, in computed tokens
        # the share of a computed token's cost a token loaded from host / from storage saves
        self._host_saves = 1 - fleet.host_s_per_token / fleet.prefill_s_per_token
        self._storage_saves = 1 - (fleet.host_s_per_token + fleet.storage_s_per_token) / fleet.prefill_s_per_token
        self.identity = KVIdentity.from_config(fleet.runtime_config(storage_dir))
        self.index = PrefixIndex(shared_storage=True)
        self.instances: list[Instance] = []
        self._rng = random.Random(seed)
        self._rr = itertools.count()
        self._ctx = zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._decode = msgspec.msgpack.Decoder(Result)

    async def __aenter__(self) -> "Router":
        procs = [subprocess.Popen([sys.executable, __file__, "serve", "--index", str(i), "--storage-dir",
                                   self.storage_dir, "--fleet", json.dumps(self.fleet.__dict__)],
                                  stdout=subprocess.PIPE, text=True) for i in range(self.n)]
        for i, proc in enumerate(procs):
            line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"instance {i} did not start (exit code {proc.wait()})")
            ends = json.loads(line)
            inst = Instance(i, proc, ends["requests"], ends["events"], ends["replay"])
            inst.sock = self._ctx.socket(zmq.DEALER)
            inst.sock.connect(inst.requests)
            self.instances.append(inst)
            self._tasks.append(asyncio.create_task(self._follow(inst)))
            self._tasks.append(asyncio.create_task(self._replies(inst)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for inst in self.instances:
            await inst.sock.send_multipart((b"", msgspec.msgpack.encode({"op": "stop"})))
        for inst in self.instances:
            await asyncio.to_thread(inst.proc.wait, 60)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for inst in self.instances:
            inst.sock.close(linger=0)
        self._ctx.term()

    def choose(self, prompt: np.ndarray) -> int:
        """The instance for `prompt` by the policy."""
        if self.policy == "round_robin":
            return next(self._rr) % self.n
        if self.policy == "random":
            return self._rng.randrange(self.n)
        hashes = page_hashes(prompt, self.fleet.page_size, None, self.identity)
        ps = self.fleet.page_size
        least = min(inst.inflight for inst in self.instances)
        best, best_cost = 0, None
        for inst in self.instances:
            if inst.inflight > least + self.load_bound:
                continue
            hit = self.index.match(inst.index, hashes)
            # the tokens it would compute, a loaded one counted at what the forward charges for it
            # (a storage token is read, then loaded from host), and the requests queued before it
            missing = len(prompt) - (hit.device + self._host_saves * hit.host + self._storage_saves * hit.storage) * ps
            cost = (missing + inst.inflight * self.load_tokens, inst.inflight)
            if best_cost is None or cost < best_cost:
                best, best_cost = inst.index, cost
        return best

    async def submit(self, rid: str, prompt: np.ndarray, reply: np.ndarray) -> Result:
        inst = self.instances[self.choose(prompt)]
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        inst.pending[rid] = fut
        inst.inflight += 1
        try:
            await inst.sock.send_multipart((b"", msgspec.msgpack.encode(
                {"rid": rid, "prompt": prompt.astype("<i4").tobytes(), "reply": reply.astype("<i4").tobytes()})))
            return await fut
        finally:
            inst.inflight -= 1

    async def _follow(self, inst: Instance) -> None:
        sub = ZmqEventSubscriber(inst.events, replay_endpoint=inst.replay)
        try:
            async for _seq, batch in sub:
                self.index.apply(inst.index, batch)
        finally:
            sub.close()

    async def _replies(self, inst: Instance) -> None:
        while True:
            _, payload = await inst.sock.recv_multipart()
            if payload == b"stopped":
                return
            res = self._decode.decode(payload)
            inst.pending.pop(res.rid).set_result(res)


# -- a short demo --------------------------------------------------------------------------------
async def demo(n: int, policy: str, sessions: int) -> None:
    import tempfile

    rng = np.random.default_rng(0)
    systems = [rng.integers(0, 32000, 512, dtype=np.int32) for _ in range(4)]
    with tempfile.TemporaryDirectory() as storage_dir:
        async with Router(n, FleetConfig(), storage_dir, policy=policy) as router:

            async def session(s: int) -> list[Result]:
                hist, out = systems[s % len(systems)], []
                for turn in range(4):
                    prompt = np.concatenate((hist, rng.integers(0, 32000, 60, dtype=np.int32)))
                    reply = rng.integers(0, 32000, 40, dtype=np.int32)
                    out.append(await router.submit(f"s{s}t{turn}", prompt, reply))
                    hist = np.concatenate((prompt, reply))
                return out

            results = [r for rs in await asyncio.gather(*(session(s) for s in range(sessions))) for r in rs]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.device + r.host for r in results)
    per = [sum(1 for r in results if r.instance == i) for i in range(n)]
    print(f"{policy}: {len(results)} requests over {n} instances {per}; {cached / prompt:.1%} of prompt tokens "
          f"cached (device {sum(r.device for r in results)}, host {sum(r.host - r.storage for r in results)}, "
          f"storage {sum(r.storage for r in results)}), {prompt - cached} computed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    s = sub.add_parser("serve", help="(internal) one instance")
    s.add_argument("--index", type=int, required=True)
    s.add_argument("--storage-dir", required=True)
    s.add_argument("--fleet", required=True)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--policy", choices=POLICIES, default=None, help="one policy (default: all three)")
    ap.add_argument("--quick", action="store_true", help="2 instances, 6 conversations, events routing only (a smoke run)")
    ap.add_argument("--tiny", action="store_true", help="(the forward is simulated: accepted for the examples' test)")
    a = ap.parse_args()
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover
        run = asyncio.run
    if a.cmd == "serve":
        run(serve(a.index, FleetConfig(**json.loads(a.fleet)), a.storage_dir))
        return
    for policy in [a.policy] if a.policy else ("events",) if a.quick else POLICIES:
        run(demo(2 if a.quick else a.instances, policy, 6 if a.quick else 16))


if __name__ == "__main__":
    main()
