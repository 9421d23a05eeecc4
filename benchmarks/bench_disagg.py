"""Prefill/decode disaggregation on a multi-turn trace: KV bytes moved with the decode side's own
tiers vs without them, and the decode side's time to first token.

One process, the tiny random Llama, the in-process transport (`LocalTransport`: the bytes asked
for and written are the same as over Mooncake's Transfer Engine; the time is not a network's).
A prefill runtime serves `PrefillServer` fills; a decode runtime reads from it (`PeerBackend`).

Trace (the `bench_serving` shape, fewer conversations): ``--convs`` (16) conversations x
``--turns`` (6) turns, every one starting with the same ``--system`` (512) token system prompt;
each turn appends a user message of about ``--user`` (128) tokens and the greedy reply of
``--reply`` (128) tokens, carried into the next turn; ``--active`` (4) conversations at once.

Configurations (same trace, same prefill side, a fresh one each):

- ``tiers``: the decode side keeps device + host tiers (host = 4x device): a turn asks the peer
  only for the pages its tiers lack;
- ``no_tiers``: the decode side keeps nothing between turns (device and host flushed after every
  turn; a storage read lands in the host tier, so it cannot be off): every turn asks for its
  whole prefix.

Reported: bytes the peer wrote, the ideal (per turn, the full prompt pages the decode side's tiers
did not hold as the turn asked, `match_prefix` just before it is submitted, counted on the
`tiers` run), their ratio (target <= 1.1x) and `no_tiers` bytes / ideal (target >= 5x);
decode-side TTFT median (arrival at the serving loop -> first token). Also the pages lacked at
admission: less, when a concurrent conversation's fill of the same prefix (the system prompt)
landed between the ask and the admission (each asked for it). The last stdout line is JSON.

    python benchmarks/bench_disagg.py            # 16 conversations x 6 turns (about 2 minutes on CPU)
    python benchmarks/bench_disagg.py --quick    # 4 x 3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import emit_json, git_commit, median  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.disagg.peer_backend import PeerBackend  # noqa: E402
from runtime.disagg.prefill_server import PrefillServer  # noqa: E402
from runtime.disagg.transport import LocalTransport  # noqa: E402
from runtime.integrations.hf_llama import PagedKVModel, kv_geometry, tiny_llama  # noqa: E402
from runtime.integrations.serving import ServingLoop  # noqa: E402
from runtime.runtime import CacheRuntime  # noqa: E402
from runtime.storage.hashing import KVIdentity  # noqa: E402

PAGE = 16


def config(model: Any, **kw: Any) -> RuntimeConfig:
    layers, heads, dim = kv_geometry(model.config)
    base = dict(num_layers=layers, num_kv_heads=heads, head_dim=dim, page_size=PAGE, device_slots=4096,
                host_tokens=16384, host_layout="page_first", model_id="tiny-llama")
    base.update(kw)
    return RuntimeConfig(**base)


async def conversation(srv: ServingLoop, rt: CacheRuntime, peer: PeerBackend, conv: int, args: argparse.Namespace,
                       system: list[int], flush: bool, out: list[dict[str, float]]) -> None:
    rng = random.Random(conv)
    history = list(system)
    for _turn in range(args.turns):
        history += rng.choices(range(3, 512), k=max(1, args.user + rng.randint(-8, 8)))
        full = (len(history) - 1) // PAGE
        held = await rt.match_prefix(history)  # what the decode side's tiers hold as the turn asks
        peer.expect(history)
        c = await srv.generate(history, max_new_tokens=args.reply, rid=f"c{conv}")
        m = c.metrics
        out.append({"ttft_s": m.ttft_s, "lacked_pages": full - (held["device"] + held["host"]) // PAGE,
                    "lacked_at_admission": full - (m.device_tokens + m.host_tokens) // PAGE})
        history += c.tokens
        if flush:
            await rt.flush()


async def run(name: str, model: Any, args: argparse.Namespace, tiers: bool) -> dict[str, Any]:
    pcfg = config(model)
    dcfg = config(model, prefetch_policy="wait_complete", storage_timeout_s=60.0)
    system = random.Random(7).choices(range(3, 512), k=args.system)
    turns: list[dict[str, float]] = []
    async with CacheRuntime.open(pcfg) as prt, \
            PrefillServer(prt, PagedKVModel(copy.deepcopy(model), prt.device_pool), LocalTransport()) as server:
        peer = await asyncio.to_thread(PeerBackend, server.endpoint, LocalTransport(), KVIdentity.from_config(dcfg),
                                       PAGE, PAGE * dcfg.bytes_per_token, timeout_s=60.0)
        async with CacheRuntime.open(dcfg, storage=peer) as drt, \
                ServingLoop(drt, PagedKVModel(model, drt.device_pool), max_running=args.active) as srv:
            t0 = time.perf_counter()
            queue = list(range(args.convs))

            async def client() -> None:
                while queue:
                    await conversation(srv, drt, peer, queue.pop(0), args, system, not tiers, turns)

            await asyncio.gather(*(client() for _ in range(args.active)))
            wall = time.perf_counter() - t0
        peer.close()
    return {"config": name, "bytes": peer.counters["bytes_filled"], "pages": peer.counters["pages_filled"],
            "fills": peer.counters["fills"], "ideal_pages": sum(int(t["lacked_pages"]) for t in turns),
            "lacked_at_admission_pages": sum(int(t["lacked_at_admission"]) for t in turns),
            "ttft_median_ms": 1000 * median([t["ttft_s"] for t in turns]), "wall_s": wall, "turns": len(turns)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_llama(seed=0)
    tiers = await run("tiers", model, args, tiers=True)
    no_tiers = await run("no_tiers", model, args, tiers=False)
    page_bytes = PAGE * config(model).bytes_per_token
    ideal = tiers["ideal_pages"] * page_bytes
    print(f"{'config':>9} {'pages sent':>10} {'MiB sent':>9} {'x ideal':>8} {'TTFT p50 ms':>12} {'wall s':>7}")
    for r in (tiers, no_tiers):
        r["x_ideal"] = r["bytes"] / ideal if ideal else float("nan")
        print(f"{r['config']:>9} {r['pages']:>10} {r['bytes'] / 2**20:>9.2f} {r['x_ideal']:>8.2f} "
              f"{r['ttft_median_ms']:>12.1f} {r['wall_s']:>7.1f}")
    print(f"ideal (pages the decode side's tiers lacked as each turn asked): {tiers['ideal_pages']} pages, "
          f"{ideal / 2**20:.2f} MiB (at admission: {tiers['lacked_at_admission_pages']}); targets: tiers <= 1.1x "
          f"ideal, no_tiers >= 5x")
    return {"bench": "disagg", "commit": git_commit(), "args": vars(args), "tiers": tiers, "no_tiers": no_tiers,
            "ideal_bytes": ideal}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--convs", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--system", type=int, default=512)
    p.add_argument("--user", type=int, default=128)
    p.add_argument("--reply", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="4 conversations x 3 turns")
    args = p.parse_args()
    if args.quick:
        args.convs, args.turns, args.active = 4, 3, 2
    emit_json(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
