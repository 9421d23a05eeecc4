"""Multi-turn serving through `ServingLoop` on a random Llama: what each cache tier saves.

Models (``--model``): ``tiny`` (4 layers, hidden 128: a prefill costs almost nothing, so whatever
the cache adds to a turn's critical path shows) and, on CUDA, ``8b``: Llama-3-8B's architecture
in bf16 with random weights made in place on the device (`llama3_8b_random`; nothing is
downloaded), whose prefill costs what a real model's does. On CPU ``--model 8b`` is refused
(16 GB of weights, minutes per forward).

Trace: ``--convs`` (64) conversations x ``--turns`` (6) turns. Every conversation starts with
the same ``--system`` (512) token system prompt; each turn appends a user message of about
``--user`` (128, +-16) random tokens and the model's greedy reply of exactly ``--reply``
(128) tokens (no EOS), which the next turn carries in its history. ``--active`` (16)
conversations run at once (a client task per slot takes the next conversation when its own
ends). Before the clients start, one request with the bare system prompt warms it (in every
configuration, and in the ideal count) so the first 16 turns do not all prefill it at once.

Sizing: working set W = unique tokens of the whole trace (system + all user messages + all
replies); device pool = W/8 (page multiple); host = 4x device; storage unbounded
(``FileBackend`` in a temp dir).

Configurations (same model, same trace, same device pool):

- ``no_reuse``: every request gets its own ``extra_key`` (its rid), so no prefix ever
  matches: each turn prefills its whole prompt (host tier off);
- ``device``: ``host_tokens=0``;
- ``device_host``: host = 4x device (write-through);
- ``device_host_storage``: as above + file storage (write-through to storage after host
  backups, ``prepare`` prefetch with ``wait_complete``).

Reported per configuration: prompt tokens recomputed (admission + preemption resumes), TTFT
median / p99 over all turns (arrival at the loop -> first token), throughput (generated
tokens / wall s), tokens served per tier, and the ideal (infinite cache) recompute count:
per turn, everything beyond the page-aligned part of the previous turn's prompt + reply
(the last reply token's KV is never written) and never the last prompt token; the system
prompt once. Ratios: recompute / ideal, TTFT median / no_reuse's. Targets: d+h+s <= 1.05x
ideal, d+h <= 1.2x ideal, d+h median TTFT <= 0.5x no_reuse (the 8B-size model on a GPU) and
<= 1.0x (reuse never slower than recomputing, any model). The last stdout line is JSON.

    python benchmarks/bench_serving.py            # full trace (several minutes on CPU)
    python benchmarks/bench_serving.py --quick    # 16 conversations x 3 turns, 4 active
    python benchmarks/bench_serving.py --quick --device cuda --model 8b
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, median, percentile  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, kv_geometry, llama3_8b_random, tiny_llama  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

PAGE = 16
CONFIGS = ("no_reuse", "device", "device_host", "device_host_storage")


def user_tokens(conv: int, turn: int, mean: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(1_000_003 * (conv + 1) + turn)
    n = mean + int(torch.randint(-mean // 8, mean // 8 + 1, (1,), generator=g))
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def system_tokens(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def ideal_recompute(system: int, convs: list[list[tuple[int, int]]]) -> int:
    """Infinite cache: (prompt_len, reply_len) per turn of each conversation."""
    total = system  # the warm-up request
    warm = system // PAGE * PAGE
    for turns in convs:
        have = warm
        for plen, rlen in turns:
            hit = min(have, (plen - 1) // PAGE * PAGE)
            total += plen - hit
            have = (plen + rlen - 1) // PAGE * PAGE
    return total


async def run_config(name: str, model: Any, args: argparse.Namespace, device_slots: int, host_tokens: int,
                     tmp: str) -> dict[str, Any]:
    layers, kv_heads, head_dim = kv_geometry(model.config)
    vocab = model.config.vocab_size
    kw: dict[str, Any] = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=PAGE,
                              kv_dtype=str(model.dtype).removeprefix("torch."),
                              device_slots=device_slots, host_tokens=host_tokens if name.startswith("device_host") else 0,
                              write_policy="write_through", device=args.device, reuse_cost=args.reuse_cost)
    if name == "device_host_storage":
        kw.update(storage_backend="file", storage_dir=str(Path(tmp) / "kv"))
    cfg = RuntimeConfig(**kw)
    system = system_tokens(args.system, vocab)
    lengths: list[list[tuple[int, int]]] = [[] for _ in range(args.convs)]
    metrics: list[Any] = []
    async with CacheRuntime.open(cfg) as rt:
        async with ServingLoop(rt, PagedKVModel(model, rt.device_pool), max_running=args.active,
                               max_prefill_tokens=args.prefill_budget, max_reserve=args.reply) as srv:
            no_reuse = name == "no_reuse"
            warm = await srv.generate(system, max_new_tokens=1, rid="warm", extra_key="warm" if no_reuse else None)
            next_conv = iter(range(args.convs))
            t0 = time.perf_counter()

            async def client() -> None:
                for c in next_conv:
                    history = list(system)
                    for t in range(args.turns):
                        history += user_tokens(c, t, args.user, vocab)
                        rid = f"c{c}t{t}"
                        out = await srv.generate(history, max_new_tokens=args.reply, rid=rid, eos_token_ids=(),
                                                 extra_key=rid if no_reuse else None)
                        lengths[c].append((len(history), len(out.tokens)))
                        metrics.append(out.metrics)
                        history += out.tokens

            await asyncio.gather(*(client() for _ in range(args.active)))
            wall = time.perf_counter() - t0
        stats = await rt.stats()
    ttft = [m.ttft_s for m in metrics]
    gen = sum(m.generated_tokens for m in metrics)
    wm = warm.metrics
    return {
        "config": name,
        "device_slots": device_slots,
        "host_tokens": cfg.host_slots,
        "turns": len(metrics),
        "recomputed": wm.recomputed_tokens + sum(m.recomputed_tokens + m.resume_recomputed_tokens for m in metrics),
        "device_tokens": sum(m.device_tokens for m in metrics),
        "host_tokens_served": sum(m.host_tokens for m in metrics),
        "storage_tokens": sum(m.storage_tokens for m in metrics),
        "preemptions": sum(m.preemptions for m in metrics),
        "ttft_median_ms": 1e3 * median(ttft),
        "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "throughput_tok_s": gen / wall,
        "wall_s": wall,
        "ideal": ideal_recompute(len(system), lengths),
        "rt_storage_hit": stats["storage"]["hit_tokens"],
        "host_hit_recomputed": stats["host"]["hit_tokens_recomputed"],  # the load-cost model chose to recompute
        "storage_pages_written": stats["storage"]["written_pages"],
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = llama3_8b_random(args.device) if args.model == "8b" else tiny_llama(seed=0).to(args.device)
    working_set = args.system + args.convs * args.turns * (args.user + args.reply)
    device_slots = max(PAGE, working_set // 8 // PAGE * PAGE)
    host_tokens = 4 * device_slots
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_serving_") as tmp:
        for name in args.configs:
            row = await run_config(name, model, args, device_slots, host_tokens, tmp)
            rows.append(row)
            print(f"  {name}: {row['wall_s']:.1f}s", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["config"] == "no_reuse"), None)
    for r in rows:
        r["vs_ideal"] = r["recomputed"] / r["ideal"]
        r["ttft_vs_no_reuse"] = r["ttft_median_ms"] / base["ttft_median_ms"] if base else None
    return {"working_set": working_set, "device_slots": device_slots, "host_tokens": host_tokens, "rows": rows}


def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 conversations x 3 turns, 4 active, 256-token system")
    ap.add_argument("--convs", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--active", type=int, default=16)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--reply", type=int, default=128)
    ap.add_argument("--prefill-budget", type=int, default=4096, help="ServingLoop max_prefill_tokens")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--reuse-cost", default="measured", choices=["always", "measured"],
                    help="RuntimeConfig.reuse_cost: load every host hit, or only where loading beats recomputing "
                         "(the serving loop reports its prefills)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default="tiny", choices=["tiny", "8b"],
                    help="tiny: the 4-layer random Llama; 8b: Llama-3-8B's architecture, random bf16 weights (CUDA only)")
    ap.add_argument("--device", default="cpu",
                    help="the model's and the device pool's torch device (cuda: the CUDA copy engine moves the KV)")
    args = ap.parse_args()
    if args.model == "8b" and not args.device.startswith("cuda"):
        ap.exit(2, "bench_serving: --model 8b needs --device cuda (16 GB of bf16 weights; a forward takes minutes "
                   "on a CPU); the tiny model (the default) runs on CPU\n")
    if args.quick:
        args.convs, args.turns, args.active, args.system, args.user, args.reply = 16, 3, 4, 256, 64, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    res = asyncio.run(main_async(args))
    print(f"working set {res['working_set']} tokens; device {res['device_slots']}; host {res['host_tokens']}; "
          f"{args.convs} convs x {args.turns} turns, {args.active} active")
    hdr = (f"{'config':<20} {'recomputed':>10} {'ideal':>8} {'vs ideal':>8} {'dev':>7} {'host':>7} {'storage':>7} "
           f"{'preempt':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'vs none':>7} {'tok/s':>7}")
    print(hdr)
    for r in res["rows"]:
        vs = f"{r['ttft_vs_no_reuse']:.2f}" if r["ttft_vs_no_reuse"] is not None else "-"
        print(f"{r['config']:<20} {r['recomputed']:>10} {r['ideal']:>8} {r['vs_ideal']:>8.3f} {r['device_tokens']:>7} "
              f"{r['host_tokens_served']:>7} {r['storage_tokens']:>7} {r['preemptions']:>7} "
              f"{r['ttft_median_ms']:>7.1f}ms {r['ttft_p99_ms']:>7.1f}ms {vs:>7} {r['throughput_tok_s']:>7.0f}")
    by = {r["config"]: r for r in res["rows"]}
    targets = {}
    if "device_host_storage" in by:
        targets["dhs_recompute_le_1.05x_ideal"] = by["device_host_storage"]["vs_ideal"] <= 1.05
    if "device_host" in by:
        targets["dh_recompute_le_1.2x_ideal"] = by["device_host"]["vs_ideal"] <= 1.2
        if by["device_host"]["ttft_vs_no_reuse"] is not None:
            targets["dh_ttft_median_le_0.5x_no_reuse"] = by["device_host"]["ttft_vs_no_reuse"] <= 0.5
            targets["dh_ttft_median_le_1.0x_no_reuse"] = by["device_host"]["ttft_vs_no_reuse"] <= 1.0
    print("targets: " + ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in targets.items()))
    emit_json({"bench": "serving", "quick": args.quick, "device": args.device, "model": args.model,
               "machine": platform.processor() or platform.machine(),
               "convs": args.convs, "turns": args.turns, "active": args.active, **res, "targets": targets})


if __name__ == "__main__":
    main()
