"""The tiers-only connector under vLLM 0.33's real scheduler: tokens served, recomputed, and
the connector's scheduler time beside vLLM's own.

A multi-turn chat trace (W waves of S sessions, one shared system prompt, each turn the
session's history plus a new user message, a reply of R tokens) runs through vLLM's `Scheduler`
and the connector's scheduler and worker sides in one process: each turn, wave after wave, a
wave's S sessions run their turn together; the GPU pool holds about one wave, so vLLM's own
prefix cache loses a session's history before its next turn. The model forward is a stand-in that writes no KV and samples from (request, position),
so every configuration sees the same trace; only the scheduler and the connector do real work
(the worker's copies are real tensor copies between the paged KV tensors and the host pool).

Configurations, one sitting:
- `ideal`:   no connector, a GPU pool big enough for every conversation (vLLM's own prefix cache
             then holds everything: the fewest tokens block-granular caching can compute);
- `vllm`:    no connector, the small GPU pool;
- `host`:    the connector with a host tier (`host_blocks`), the small GPU pool;
- `storage`: the connector with a host tier a quarter that size and a storage directory.

Reported: tokens computed (prefill + decode) and their ratio to `ideal`; tokens the connector
loaded (host, storage); per step, vLLM's `schedule()` time without the connector's calls in it,
and the connector's scheduler-side time (all its methods vLLM's scheduler calls:
`get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`,
`request_finished`, `update_connector_output`, `has_pending_push_work`), means over the steps
with at least `--busy` running requests and their ratio, and the ratio of the sums over all
steps (admission and finish steps, where the connector's work is, included). Targets: computed <= 1.1x
ideal; connector time <= 10% of `schedule()` at 256 running requests.

    .venv/bin/python benchmarks/bench_vllm_connector.py [--sessions 256] [--turns 4] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.vllm_engine import BLOCK, VOCAB, FakeEngine, save_tiny_model, vllm_config  # noqa: E402

CONNECTOR_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "update_connector_output", "has_pending_push_work")
IN_SCHEDULE = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")


class TimedEngine(FakeEngine):
    """FakeEngine with a forward that writes nothing, and timers around the scheduler's calls
    (`has_pending_push_work` is timed where vLLM calls it: in `has_requests`, by the run loop)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.connector_ns = 0  # connector scheduler-side time, this step
        self.in_schedule_ns = 0  # the part of it spent inside schedule()
        self.schedule_ns = 0  # schedule() without that part, this step
        self.running = 0  # requests running after this step's schedule()
        self.samples: list[tuple[int, int, int]] = []  # (running, schedule ns w/o connector, connector ns)
        conn = self.connector
        if conn is not None:
            for name in CONNECTOR_CALLS:
                setattr(conn, name, self._timed(getattr(conn, name), name in IN_SCHEDULE))

    def _timed(self, fn: Callable[..., Any], in_schedule: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                self.connector_ns += dt
                if in_schedule:
                    self.in_schedule_ns += dt
        return timed

    def step(self) -> None:
        self.connector_ns = self.in_schedule_ns = 0
        super().step()
        self.samples.append((self.running, self.schedule_ns, self.connector_ns))

    def _schedule(self) -> Any:
        t0 = time.perf_counter_ns()
        so = self.scheduler.schedule()
        self.schedule_ns = time.perf_counter_ns() - t0 - self.in_schedule_ns
        self.running = len(self.scheduler.running)
        return so

    def _forward(self, so: Any) -> dict[str, list[int]]:
        """No KV written: each finished prefill or decode step samples from (request, position)."""
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            self.computed[rid] = self.computed.get(rid, 0) + n
            end = req.num_computed_tokens
            if end >= req.num_tokens:
                sampled[rid] = [zlib.crc32(f"{rid}:{end}".encode()) % (VOCAB - 10) + 10]
        return sampled


def run_trace(e: TimedEngine, waves: int, sessions: int, turns: int, system: int, user: int, reply: int) -> None:
    """Each turn, wave after wave: a wave's sessions run their turn together (`sessions`
    requests at once), then the next wave's; a session's next turn comes after every other wave."""
    history = {s: [100 + i % 900 for i in range(system)] for s in range(waves * sessions)}
    for turn in range(turns):
        for wave in range(waves):
            group = range(wave * sessions, (wave + 1) * sessions)
            for s in group:
                history[s] += [(200 + 37 * s + 11 * turn + i) % 990 + 10 for i in range(user)]
                e.add(f"s{s}t{turn}", history[s], reply)
            e.run(max_steps=10**7)
            for s in group:
                history[s] += e.outputs[f"s{s}t{turn}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4, help="groups of sessions taking turns")
    ap.add_argument("--system", type=int, default=256, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=64, help="user message tokens per turn")
    ap.add_argument("--reply", type=int, default=16, help="reply tokens per turn")
    ap.add_argument("--busy", type=int, default=256, help="steps with at least this many running count")
    ap.add_argument("--quick", action="store_true", help="32 sessions, 3 turns (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.busy = 32, 3, 32
    S, T, W = args.sessions, args.turns, args.waves
    longest = args.system + T * (args.user + args.reply)
    per_wave = S * -(-longest // BLOCK)  # blocks one wave's last turn runs in
    small = per_wave + 64  # the small pool: one wave running, little to keep for the next
    big = W * per_wave + 64  # every conversation stays
    host = W * per_wave  # the host tier keeps every conversation (the storage run's: a quarter)
    model = tempfile.mkdtemp(prefix="bench-vllm-model-")
    save_tiny_model(model)
    cfg = dict(max_batched=8192, max_seqs=max(S, 16))
    rows = []
    for name, blocks, connector, extra in (
        ("ideal", big, None, {}),
        ("vllm", small, None, {}),
        ("host", small, "HiCacheConnector", {"host_blocks": host}),
        ("storage", small, "HiCacheConnector",
         {"host_blocks": host // 4, "storage_dir": tempfile.mkdtemp(prefix="bench-vllm-kv-")}),
    ):
        e = TimedEngine(vllm_config(model, connector=connector, extra=extra, **cfg), blocks)
        t0 = time.perf_counter()
        run_trace(e, W, S, T, args.system, args.user, args.reply)
        wall = time.perf_counter() - t0
        busy = [(s, c) for r, s, c in e.samples if r >= args.busy]
        stats = e.connector.core.stats if e.connector is not None else {}
        rows.append(dict(name=name, blocks=blocks, computed=sum(e.computed.values()), wall=wall, steps=e.steps,
                         busy=len(busy), sched=statistics.fmean(s for s, _ in busy) / 1e6 if busy else float("nan"),
                         conn=statistics.fmean(c for _, c in busy) / 1e6 if busy else float("nan"),
                         total=sum(c for _, _, c in e.samples) / max(1, sum(s for _, s, _ in e.samples)),
                         loaded=stats.get("tokens_loaded", 0), from_storage=stats.get("tokens_storage_loaded", 0),
                         outputs=e.outputs))
        if e.worker is not None:
            e.worker.shutdown()
    ideal = rows[0]["computed"]
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    print(f"trace: {W} waves of {S} sessions x {T} turns, system {args.system}, user {args.user}, reply {args.reply} tokens; "
          f"block {BLOCK}; GPU pool {small} blocks (ideal: {big}); host tier {host} blocks (storage run: {host // 4}); "
          f"outputs equal in every run: {same}")
    print(f"| run | GPU blocks | tokens computed | vs ideal | loaded (from storage) | steps | "
          f"steps with >= {args.busy} running | schedule() ms/step (w/o connector) | connector ms/step | "
          f"connector / schedule() | same, all steps | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r["conn"] / r["sched"] if r["name"] in ("host", "storage") else float("nan")
        print(f"| {r['name']} | {r['blocks']} | {r['computed']:,} | {r['computed'] / ideal:.3f}x | "
              f"{r['loaded']:,} ({r['from_storage']:,}) | {r['steps']} | {r['busy']} | {r['sched']:.2f} | "
              f"{r['conn']:.3f} | {ratio:.1%} | {r['total']:.1%} | {r['wall']:.1f} |")


if __name__ == "__main__":
    main()
