"""The tiers-only connector and vLLM's own `OffloadingConnector` under vLLM 0.33's real scheduler,
side by side on one trace: tokens served, recomputed, and each connector's scheduler time
beside vLLM's own.

A multi-turn chat trace (W waves of S sessions, one shared system prompt, each turn the
session's history plus a new user message, a reply of R tokens) runs through vLLM's `Scheduler`
and a connector's scheduler and worker sides in one process: each turn, wave after wave, a
wave's S sessions run their turn together; the GPU pool holds about one wave, so vLLM's own
prefix cache loses a session's history before its next turn. The model forward is a stand-in
that writes no KV and samples from (request, position), so every configuration sees the same
trace; only the scheduler and the connectors do real work (their workers' copies are real
tensor copies between the paged KV tensors and the host tier).

Configurations, one sitting:
- `ideal`:   no connector, a GPU pool big enough for every conversation (vLLM's own prefix cache
             then holds everything: the fewest tokens block-granular caching can compute);
- `vllm`:    no connector, the small GPU pool;
- `host`:    a host tier holding every conversation, the small GPU pool: this connector
             (`host_bytes`) and vLLM's native one (`cpu_bytes_to_use`, the same bytes);
- `storage`: a host tier a quarter that size and a storage directory behind it: this
             connector's file backend, and the native `TieringOffloadingSpec` with its `fs` tier.
The native connector runs with ``offload_prompt_only: false`` (every computed block stored, as
this connector does: like for like); one more row runs it with vLLM's default (true), which
stores prompt blocks only. Its CUDA copy engine is replaced by whole-page CPU copies
(`benchmarks/peers/vllm_native_offloading.py`); its scheduler side is vLLM's.

Reported: tokens computed (prefill + decode) and their ratio to `ideal`; tokens this connector
loaded (host, storage); per step, vLLM's `schedule()` time without the connector's calls in it,
and the connector's scheduler-side time: every connector method vLLM's scheduler calls, inside
`schedule()` or not (`get_num_new_matched_tokens`, `update_state_after_alloc`,
`build_connector_meta`, `request_finished`, `update_connector_output`, `has_pending_push_work`,
`on_new_request`, `take_events`, `get_kv_connector_stats`, ...). Their share: the mean over the
steps with at least `--busy` running requests (busy), and the ratio of their sums over all steps
(whole run: admission and finish steps, where a per-request connector's work is, included);
and the connector's time per request. Targets: this connector's share <= 0.5x the native one's
(busy and whole run); the storage run's time per request <= 2x the host run's; computed <=
1.01x ideal.

    .venv/bin/python benchmarks/bench_vllm_connector.py [--sessions 256] [--turns 3] [--reply 16] [--quick]
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

from tests.e2e.vllm_engine import BLOCK, HEAD, KV_HEADS, LAYERS, VOCAB, FakeEngine, save_tiny_model, vllm_config  # noqa: E402

from benchmarks.peers import vllm_native_offloading as native  # noqa: E402

# every KV-connector method vLLM 0.33's Scheduler calls while serving (vllm/v1/core/sched/scheduler.py)
CONNECTOR_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "request_finished", "request_finished_all_groups", "update_connector_output",
                   "has_pending_push_work", "has_pending_block_frees", "on_new_request", "take_events",
                   "get_kv_connector_stats", "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
                   "register_finished_partial_tail")


_clock = time.perf_counter_ns  # (--thread-time: the scheduler thread's CPU time instead)


class TimedEngine(FakeEngine):
    """FakeEngine with a forward that writes nothing, and timers around every connector call vLLM's
    scheduler makes. A call's time goes to the step it ran in or, between steps (`add_request`'s
    `on_new_request`, the run loop's `has_pending_push_work`), to the next; a call inside
    `schedule()` is taken out of `schedule()`'s time."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.connector_ns = 0  # connector scheduler-side time since the last step's sample
        self.in_schedule_ns = 0  # the part of it spent inside schedule()
        self.schedule_ns = 0  # schedule() without that part, this step
        self.connector_total_ns = 0
        self.per_call_ns: dict[str, int] = {}  # connector time by method, whole run
        self._scheduling = False
        self.running = 0  # requests running after this step's schedule()
        self.samples: list[tuple[int, int, int]] = []  # (running, schedule ns w/o connector, connector ns)
        conn = self.scheduler.connector  # (vLLM's facade: its hand-off to the scheduler side timed too)
        if conn is not None:
            for name in CONNECTOR_CALLS:
                if hasattr(conn, name):
                    setattr(conn, name, self._timed(getattr(conn, name), name))

    def _timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = _clock() - t0
                self.connector_ns += dt
                self.per_call_ns[name] = self.per_call_ns.get(name, 0) + dt
                if self._scheduling:
                    self.in_schedule_ns += dt
        return timed

    def step(self) -> None:
        super().step()
        self.samples.append((self.running, self.schedule_ns, self.connector_ns))
        self.connector_total_ns += self.connector_ns
        self.connector_ns = 0

    def _schedule(self) -> Any:
        self.in_schedule_ns = 0
        self._scheduling = True
        t0 = _clock()
        try:
            so = self.scheduler.schedule()
        finally:
            self._scheduling = False
        self.schedule_ns = _clock() - t0 - self.in_schedule_ns
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


def run(name: str, config: Any, blocks: int, args: argparse.Namespace) -> dict[str, Any]:
    e = TimedEngine(config, blocks)
    t0 = time.perf_counter()
    run_trace(e, args.waves, args.sessions, args.turns, args.system, args.user, args.reply)
    wall = time.perf_counter() - t0
    busy = [(s, c) for r, s, c in e.samples if r >= args.busy]
    core = getattr(e.connector, "core", None)  # (this connector's; the native one counts otherwise)
    stats = core.stats if core is not None else {}
    sched_busy = statistics.fmean(s for s, _ in busy) / 1e6 if busy else float("nan")
    conn_busy = statistics.fmean(c for _, c in busy) / 1e6 if busy else float("nan")
    row = dict(name=name, blocks=blocks, computed=sum(e.computed.values()), wall=wall, steps=e.steps, busy=len(busy),
               sched=sched_busy, conn=conn_busy, share_busy=conn_busy / sched_busy if busy else float("nan"),
               share_all=sum(c for _, _, c in e.samples) / max(1, sum(s for _, s, _ in e.samples)),
               us_per_request=e.connector_total_ns / 1e3 / len(e.outputs),
               loaded=stats.get("tokens_loaded"), from_storage=stats.get("tokens_storage_loaded"),
               outputs=e.outputs, has_connector=e.connector is not None,
               per_call={k: v / 1e3 / len(e.outputs) for k, v in e.per_call_ns.items()})
    if e.scheduler.connector is not None:
        e.scheduler.connector.shutdown()
    for w in e.workers:
        w.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--waves", type=int, default=4, help="groups of sessions taking turns")
    ap.add_argument("--system", type=int, default=256, help="system prompt tokens")
    ap.add_argument("--user", type=int, default=64, help="user message tokens per turn")
    ap.add_argument("--reply", type=int, default=16, help="reply tokens per turn")
    ap.add_argument("--busy", type=int, default=256, help="steps with at least this many running count")
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--thread-time", action="store_true",
                    help="time with the scheduler thread's CPU time (leaves out waits for the GIL held by worker threads)")
    ap.add_argument("--calls", action="store_true", help="also print each connector's µs per request by method")
    ap.add_argument("--quick", action="store_true", help="32 sessions, 3 turns (a smoke run)")
    args = ap.parse_args()
    if args.thread_time:
        global _clock
        _clock = time.thread_time_ns
    if args.quick:
        args.sessions, args.turns, args.busy = 32, 3, 32
    S, T, W = args.sessions, args.turns, args.waves
    longest = args.system + T * (args.user + args.reply)
    per_wave = S * -(-longest // BLOCK)  # blocks one wave's last turn runs in
    small = per_wave + 64  # the small pool: one wave running, little to keep for the next
    big = W * per_wave + 64  # every conversation stays
    host = W * per_wave  # the host tier keeps every conversation (the storage runs': a quarter)
    model = tempfile.mkdtemp(prefix="bench-vllm-model-")
    save_tiny_model(model)
    block_bytes = LAYERS * 2 * KV_HEADS * HEAD * BLOCK * 4  # a vLLM block of every layer, float32
    cfg = dict(max_batched=8192, max_seqs=max(S, 16))

    def store() -> str:
        return tempfile.mkdtemp(prefix="bench-vllm-kv-")

    runs: list[tuple[str, int, str | None, str, Callable[[], dict[str, Any]]]] = [
        ("ideal", big, None, "", dict),
        ("vllm", small, None, "", dict),
        ("host", small, "HiCacheConnector", "runtime.integrations.vllm", lambda: {"host_bytes": host * block_bytes}),
        ("native host", small, native.CONNECTOR, native.MODULE, lambda: native.extra_config(host * block_bytes)),
        ("native host, prompt only", small, native.CONNECTOR, native.MODULE,
         lambda: native.extra_config(host * block_bytes, prompt_only=True)),
        ("storage", small, "HiCacheConnector", "runtime.integrations.vllm",
         lambda: {"host_bytes": host // 4 * block_bytes, "storage_dir": store()}),
        ("native storage", small, native.CONNECTOR, native.MODULE,
         lambda: native.extra_config(host // 4 * block_bytes, store())),
    ]
    only = set(filter(None, args.only.split(","))) | {"ideal"}
    rows = []
    for name, blocks, connector, module, extra in runs:
        if args.only and name not in only:
            continue
        config = vllm_config(model, connector=connector, module=module or "runtime.integrations.vllm",
                             extra=extra(), **cfg)
        rows.append(run(name, config, blocks, args))
    ideal = rows[0]["computed"]
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    print(f"trace: {W} waves of {S} sessions x {T} turns, system {args.system}, user {args.user}, reply {args.reply} "
          f"tokens; block {BLOCK} ({block_bytes} bytes); GPU pool {small} blocks (ideal: {big}); host tier {host} "
          f"blocks (storage runs: {host // 4}); outputs equal in every run: {same}")
    print(f"| run | tokens computed | vs ideal | loaded (from storage) | steps | steps with >= {args.busy} running | "
          f"schedule() ms/step (w/o connector) | connector ms/step | connector / schedule(), busy | "
          f"same, whole run | connector µs/request | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        loaded = "—" if r["loaded"] is None else f"{r['loaded']:,} ({r['from_storage']:,})"
        timed = r["has_connector"]
        print(f"| {r['name']} | {r['computed']:,} | {r['computed'] / ideal:.3f}x | {loaded} | {r['steps']} | {r['busy']} | "
              f"{r['sched']:.2f} | {r['conn']:.3f} | " + (f"{r['share_busy']:.1%} | {r['share_all']:.1%} | "
              f"{r['us_per_request']:,.0f}" if timed else "— | — | —") + f" | {r['wall']:.1f} |")
    print()
    for tier in ("host", "storage"):
        ours, theirs = by_name.get(tier), by_name.get(f"native {tier}")
        if ours and theirs:
            print(f"{tier}: share of schedule() this / native: busy {ours['share_busy'] / theirs['share_busy']:.2f}x, "
                  f"whole run {ours['share_all'] / theirs['share_all']:.2f}x (target <= 0.5x); "
                  f"recompute {ours['computed'] / ideal:.3f}x ideal (target <= 1.01x)")
    if args.calls:
        for r in rows:
            if r["per_call"]:
                calls = sorted(r["per_call"].items(), key=lambda kv: -kv[1])
                print(f"{r['name']}: µs per request by method: " + ", ".join(f"{k} {v:.0f}" for k, v in calls if v >= 0.5))
    if "host" in by_name and "storage" in by_name:
        print(f"storage / host, connector µs per request: "
              f"{by_name['storage']['us_per_request'] / by_name['host']['us_per_request']:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
