"""Actor round-trip cost: `ask` latency (p50/p99) and throughput, batch cost per item; the same
round trip with a runtime message type (`Commit`), and the cost of building the hot path's
messages (`Admit`, `Commit`, one `DecodeStep`).

Baseline in the same run: a bare `asyncio.Queue` + future round trip to a consumer task.
Run on uvloop (when installed) and on plain asyncio; candidate and baseline interleaved,
median of the repeats. Last stdout line: one JSON object.

    .venv/bin/python benchmarks/bench_actor.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import timeit
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit_json, median, percentile  # noqa: E402
from runtime.actors.base import Actor, Reply  # noqa: E402
from runtime.messages import Admit, Commit, DecodeStep  # noqa: E402
from runtime.supervisor import Supervisor  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402


@dataclass(frozen=True, slots=True)
class Ping:
    n: int
    reply: Reply[int] | None = field(default=None, compare=False)


class Echo(Actor):
    name = "echo"

    def __init__(self) -> None:
        super().__init__(1 << 16)
        self.handlers = {Ping: self.on_ping, Commit: self.on_commit}

    def on_ping(self, msg: Ping) -> int:
        return msg.n + 1

    def on_commit(self, msg: Commit) -> int:
        return msg.committed_len


async def message_round_trips(sup: Supervisor, actor: Echo, n: int) -> list[float]:
    lat = []
    mailbox = actor.mailbox
    for i in range(n):
        t0 = time.perf_counter_ns()
        await sup.ask(mailbox, Commit("r", i, Reply()))
        lat.append((time.perf_counter_ns() - t0) / 1000)
    return lat


def construct_ns(n: int = 100_000) -> float:
    """Building one Admit (positional), one Commit (keyword) and one DecodeStep, in ns."""
    tokens = None
    rids = ("a", "b")

    def build() -> None:
        Admit("r", tokens, None, None, 0)
        Commit(rid="r", committed_len=3)
        DecodeStep(rids)

    return min(timeit.repeat(build, number=n, repeat=5)) / n * 1e9


async def actor_round_trips(sup: Supervisor, actor: Echo, n: int) -> list[float]:
    lat = []
    mailbox = actor.mailbox
    for i in range(n):
        t0 = time.perf_counter_ns()
        await sup.ask(mailbox, Ping(i, Reply()))
        lat.append((time.perf_counter_ns() - t0) / 1000)
    return lat


async def queue_round_trips(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def consumer():
        while True:
            item, fut = await queue.get()
            if item is None:
                return
            fut.set_result(item + 1)

    task = asyncio.ensure_future(consumer())
    lat = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fut = loop.create_future()
        queue.put_nowait((i, fut))
        await fut
        lat.append((time.perf_counter_ns() - t0) / 1000)
    queue.put_nowait((None, None))
    await task
    return lat


async def batch_per_item(sup: Supervisor, actor: Echo, batch: int, rounds: int) -> float:
    items = [Ping(i) for i in range(batch)]
    t0 = time.perf_counter()
    for _ in range(rounds):
        await sup.ask_batch(actor.mailbox, items)
    return (time.perf_counter() - t0) / (rounds * batch) * 1e6


async def measure(n: int, repeats: int) -> dict:
    actor = Echo()
    sup = Supervisor([actor])
    await sup.start()
    await actor_round_trips(sup, actor, 2000)  # warm up
    await queue_round_trips(2000)
    cand_p50, cand_p99, base_p50, base_p99, cand_tput, base_tput, batch_cost = [], [], [], [], [], [], []
    msg_p50 = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lat = await actor_round_trips(sup, actor, n)
        cand_tput.append(n / (time.perf_counter() - t0))
        cand_p50.append(percentile(lat, 50))
        cand_p99.append(percentile(lat, 99))
        t0 = time.perf_counter()
        lat = await queue_round_trips(n)
        base_tput.append(n / (time.perf_counter() - t0))
        base_p50.append(percentile(lat, 50))
        base_p99.append(percentile(lat, 99))
        batch_cost.append(await batch_per_item(sup, actor, 64, max(10, n // 64)))
        msg_p50.append(percentile(await message_round_trips(sup, actor, n), 50))
    await sup.stop()
    return {
        "ask_p50_us": median(cand_p50), "ask_p99_us": median(cand_p99), "ask_per_s": median(cand_tput),
        "queue_p50_us": median(base_p50), "queue_p99_us": median(base_p99), "queue_per_s": median(base_tput),
        "batch64_per_item_us": median(batch_cost),
        "ratio_p50": median(cand_p50) / median(base_p50),
        "message_ask_p50_us": median(msg_p50), "message_ratio_p50": median(msg_p50) / median(base_p50),
    }


def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, repeats = (5000, 5) if args.quick else (20000, 7)
    results = {}
    loops = ["asyncio"]
    try:
        import uvloop

        loops.insert(0, "uvloop")
    except ImportError:
        uvloop = None
    for name in loops:
        if name == "uvloop":
            results[name] = uvloop.run(measure(n, repeats))
        else:
            results[name] = asyncio.run(measure(n, repeats))
    build = construct_ns()
    print(f"{'loop':8} {'ask p50':>9} {'ask p99':>9} {'queue p50':>10} {'queue p99':>10} {'ratio':>6} {'ask/s':>9} {'batch/item':>11}")
    for name, r in results.items():
        print(f"{name:8} {r['ask_p50_us']:8.2f}u {r['ask_p99_us']:8.2f}u {r['queue_p50_us']:9.2f}u {r['queue_p99_us']:9.2f}u "
              f"{r['ratio_p50']:6.2f} {r['ask_per_s']:9.0f} {r['batch64_per_item_us']:10.2f}u "
              f"(Commit ask p50 {r['message_ask_p50_us']:.2f}u, ratio {r['message_ratio_p50']:.2f})")
    print(f"building Admit + Commit + DecodeStep: {build:.0f} ns")
    emit_json({"bench": "actor", "repeats": repeats, "round_trips_per_repeat": n, "results": results,
               "build_admit_commit_decode_ns": build,
               "figure": "ask_p50_us (uvloop)", "baseline": "asyncio.Queue + future round trip",
               "ratio": results[loops[0]]["ratio_p50"], "page_size": None, "model_shape": None})


if __name__ == "__main__":
    main()
