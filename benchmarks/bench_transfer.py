"""Transfer-actor throughput: backup (device->host) and load (host->device) through the actor.

The candidate is the whole copy path a request sees: a requester actor (standing in for the
tree actor) pins the plan's slots in its own ledgers, sends `SubmitCopy` to the
`TransferActor` (copy engine + completion bridge + in-order acks) and replies to the caller
when it applies the `TransferAck` (unpinning). The caller awaits that reply.

Setup, baselines and timing are those of `bench_copy_engine.py` (imported, not copied): for
each page size (1, 16, 64) and host layout (layer_first, page_first), one transfer of
>= 256 MiB (``--quick``: 32 MiB) of pages scattered on both sides, interleaved with

- ``index``: torch ``index_select`` + ``index_copy_`` of the same pages, per layer and K/V;
- ``contig``: one contiguous ``copy_`` of the same byte count (the machine's limit),

median of ``--repeats`` (>= 5) rounds. Targets: ``vs_index`` >= 0.9 everywhere and
``vs_contig`` >= 0.5 for page sizes 16 and 64. The last stdout line is one JSON object.

Shapes (``--shapes``, default both): ``args``, the MHA shape of ``--layers`` / ``--kv-heads`` /
``--head-dim`` / ``--dtype`` (K and V per token), and ``deepseek-v3``, DeepSeek-V3's MLA cache
(61 layers, one latent of 512 + 64 per token, bf16: pools of one part). ``bamba-9b-state`` (not in
the default) copies Bamba-9B's recurrent SSM state: one state slot of 29 layers x 4 MiB, the unit a
hybrid model's snapshot backup or load moves beside its KV (a state component is a pool of one-slot
pages with one part: page size 1 only). Every row names its shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# bench_copy_engine first: it sets OMP_WAIT_POLICY (passive waits, see there) before torch loads libgomp
from benchmarks._common import BAMBA_9B_SSM_STATE, DEEPSEEK_V3_MLA  # noqa: E402
from benchmarks.bench_copy_engine import (  # noqa: E402
    add_common_args,
    git_commit,
    measure,
    parse_common_args,
    use_uvloop,
)

import torch  # noqa: E402

from runtime.actors.base import DEFERRED, Actor, Mailbox, Reply  # noqa: E402
from runtime.actors.transfer_actor import TransferActor  # noqa: E402
from runtime.messages import DrainTransfer, SubmitCopy  # noqa: E402
from runtime.completion import LayerReadiness  # noqa: E402
from runtime.errors import TransferError  # noqa: E402
from runtime.memory.ledger import SlotLedger  # noqa: E402
from runtime.memory.owners import Owner, Tier  # noqa: E402
from runtime.memory.pools import DevicePool, HostPool, KVShape  # noqa: E402
from runtime.messages import Direction, TransferAck, TransferPlan  # noqa: E402
from runtime.supervisor import Supervisor  # noqa: E402
from runtime.trace import configure_logging  # noqa: E402

RESIDENT = Owner.node(0)


class _Run:
    """Ask the requester to run one plan; the reply comes with its ack."""

    __slots__ = ("plan", "reply")

    def __init__(self, plan: TransferPlan, reply: Reply[None]) -> None:
        self.plan = plan
        self.reply = reply


class BenchRequester(Actor[Any]):
    """Pins at issue, unpins at ack (the tree actor's side of a copy), replies to the caller."""

    name = "bench-requester"

    def __init__(self, transfer: Mailbox[Any], device: DevicePool, host: HostPool) -> None:
        super().__init__(1024)
        self.transfer = transfer
        self.num_layers = device.shape.num_layers
        self.ledgers = {
            Tier.DEVICE: SlotLedger(device.num_slots, device.page_size, Tier.DEVICE),
            Tier.HOST: SlotLedger(host.num_slots, host.page_size, Tier.HOST),
        }
        for led in self.ledgers.values():  # every page holds data of one owner: any page may be pinned
            led.alloc(led.num_pages, RESIDENT)
        self.waiting: dict[int, tuple[Reply[None], np.ndarray, np.ndarray]] = {}
        self.handlers = {_Run: self.on_run, TransferAck: self.on_ack}

    def on_run(self, msg: _Run) -> Any:
        plan = msg.plan
        t = plan.transfers[0]
        # the requester's own arrays, never views of the plan's tensors (seed 001)
        src = np.array(t.src.numpy(), dtype=np.int64, copy=True)
        dst = np.array(t.dst.numpy(), dtype=np.int64, copy=True)
        src_tier, dst_tier = ((Tier.DEVICE, Tier.HOST) if plan.direction is Direction.BACKUP
                              else (Tier.HOST, Tier.DEVICE))
        self.ledgers[src_tier].pin(src, plan.op_id)
        self.ledgers[dst_tier].pin(dst, plan.op_id)
        readiness = LayerReadiness.pending(self.num_layers, plan.op_id) if plan.direction is Direction.LOAD else None
        self.waiting[plan.op_id] = (msg.reply, src, dst)
        self.transfer.put_internal(SubmitCopy(plan, self.mailbox, readiness))
        return DEFERRED

    def on_ack(self, ack: TransferAck) -> None:
        reply, src, dst = self.waiting.pop(ack.op_id)
        src_tier, dst_tier = ((Tier.DEVICE, Tier.HOST) if ack.direction is Direction.BACKUP
                              else (Tier.HOST, Tier.DEVICE))
        self.ledgers[src_tier].unpin(src, ack.op_id)
        self.ledgers[dst_tier].unpin(dst, ack.op_id)
        if ack.error is None:
            reply.set_result(None)
        else:
            reply.set_exception(TransferError(ack.error))


def make_engine(pools: dict, **engine_kw: Any) -> Any:
    if next(iter(pools.values()))[0].device.type == "cuda":
        from runtime.transfer.cuda_engine import CudaCopyEngine

        return CudaCopyEngine(pools)
    from runtime.transfer.cpu_engine import CpuCopyEngine

    return CpuCopyEngine(pools, **engine_kw)


async def actor_candidate(pools: dict, **engine_kw: Any) -> tuple[Callable[[TransferPlan], Awaitable[None]],
                                                                 Callable[[], Awaitable[None]]]:
    """`bench_copy_engine` candidate: requester actor -> TransferActor -> engine, awaiting the ack."""
    device, host = pools["kv"]
    transfer = TransferActor(make_engine(pools, **engine_kw), max_inflight_loads=3, max_queued_backups=64,
                             mailbox_capacity=1024, bytes_per_slot=device.shape.bytes_per_token)
    requester = BenchRequester(transfer.mailbox, device, host)
    sup = Supervisor([requester, transfer])
    await sup.start()

    async def run(plan: TransferPlan) -> None:
        await sup.ask(requester.mailbox, _Run(plan, Reply()))

    async def close() -> None:
        await sup.ask_internal(transfer.mailbox, DrainTransfer(Reply()))
        await sup.stop()
        sup.raise_if_failed()
        assert not requester.waiting
        for led in requester.ledgers.values():
            assert int(led.snapshot().pins.sum()) == 0, "a pin outlived its copy"

    return run, close


MLA_SHAPE = KVShape(DEEPSEEK_V3_MLA["num_layers"], DEEPSEEK_V3_MLA["num_kv_heads"], DEEPSEEK_V3_MLA["head_dim"],
                    getattr(torch, DEEPSEEK_V3_MLA["kv_dtype"]), parts=1)


# a state component's rows have the geometry of a one-part pool of one-slot pages
STATE_SHAPE = KVShape(BAMBA_9B_SSM_STATE["state_layers"], 1, int(np.prod(BAMBA_9B_SSM_STATE["ssm_state"])),
                      getattr(torch, BAMBA_9B_SSM_STATE["dtype"]), parts=1)
STATE_PAGE_SIZES = {"bamba-9b-state": [1]}


def describe(shape: KVShape) -> dict[str, Any]:
    return {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "dtype": str(shape.dtype).removeprefix("torch."), "parts": shape.parts,
            "bytes_per_token": shape.bytes_per_token}


def main() -> None:
    configure_logging()  # production default: INFO to stderr (the library never configures)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--shapes", type=lambda s: s.split(","), default=["args", "deepseek-v3"],
                   help="args (the MHA shape of --layers etc.), deepseek-v3 (MLA latent), bamba-9b-state")
    args, shape, device, engine_kw = parse_common_args(p)
    named = {"args": shape, "deepseek-v3": MLA_SHAPE, "bamba-9b-state": STATE_SHAPE}
    unknown = [name for name in args.shapes if name not in named]
    if unknown or not args.shapes:
        p.error(f"--shapes takes names from {sorted(named)}, got {args.shapes}")

    async def factory(pools: dict):
        return await actor_candidate(pools, **engine_kw)

    use_uvloop()
    print(f"transfer actor ({'cuda' if device.type == 'cuda' else 'cpu'} engine), {args.mib} MiB per transfer, "
          f"median of {args.repeats}, torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    for name in args.shapes:
        print(f"shape {name}: {describe(named[name])}", flush=True)
        sized = argparse.Namespace(**{**vars(args), "page_sizes": STATE_PAGE_SIZES.get(name, args.page_sizes)})
        rows += [{"shape": name, **r} for r in asyncio.run(measure(sized, named[name], device, factory))]
    loop = type(asyncio.get_event_loop_policy()).__module__.split(".")[0]

    min_index = min(r["vs_index"] for r in rows)
    big = [r["vs_contig"] for r in rows if r["page_size"] >= 16]
    min_contig = min(big) if big else None
    print()
    print(f"{'shape':<11} {'page':>4} {'layout':<11} {'dir':<6} {'MiB':>6} {'actor ms':>9} {'GB/s':>6} {'index ms':>9} "
          f"{'contig ms':>9} {'vs_index':>8} {'vs_contig':>9}")
    for r in rows:
        print(f"{r['shape']:<11} {r['page_size']:>4} {r['layout']:<11} {r['direction']:<6} {r['mib']:>6} "
              f"{r['candidate_ms']:>9.1f} "
              f"{r['candidate_gbps']:>6.2f} {r['index_ms']:>9.1f} {r['contig_ms']:>9.1f} {r['vs_index']:>8.2f} "
              f"{r['vs_contig']:>9.2f}")
    summary = {
        "min_vs_index": min_index,
        "min_vs_contig_ps16_64": min_contig,
        "target_vs_index": 0.9,
        "target_vs_contig_ps16_64": 0.5,
        "meets_targets": bool(min_index >= 0.9 and (min_contig is None or min_contig >= 0.5)),
    }
    print(f"min vs_index {min_index:.2f} (target 0.9), min vs_contig at ps 16/64 "
          f"{'-' if min_contig is None else f'{min_contig:.2f}'} (target 0.5)", flush=True)
    print(json.dumps({
        "benchmark": "transfer",
        "candidate": "requester actor -> TransferActor -> "
                     + ("CudaCopyEngine" if device.type == "cuda" else "CpuCopyEngine") + ", awaiting the ack",
        "baselines": ["index_select+index_copy_", "contiguous copy_"],
        "shapes": {name: describe(named[name]) for name in args.shapes},
        "page_sizes": {name: STATE_PAGE_SIZES.get(name, args.page_sizes) for name in args.shapes},
        "layouts": args.layouts,
        "mib_per_transfer": args.mib,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "loop": loop,
        "engine_options": engine_kw,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "git_commit": git_commit(),
        "results": rows,
        "summary": summary,
    }))


if __name__ == "__main__":
    main()
