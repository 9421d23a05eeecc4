"""ShardedCopyEngine: one control plane's copies executed by every tensor-parallel rank.

Under tensor parallelism each rank holds its own slice of the KV heads in pools of its own, all
of one geometry; the ranks must make the same cache decisions (docs/ARCHITECTURE.md, "Tensor
parallelism"). With one control plane a single tree actor decides for the instance and every plan
it issues runs on every rank: this engine takes one engine per rank (each over that rank's pools)
and gives each of them the same immutable plan. Its handle completes a layer when every rank
completed it and fails if any rank failed (the error names the rank), so the tree actor's ack,
and everything it allows (a node's host copy counting, a device page freed after a backup, a
load's readiness), waits for the slowest rank: no rank is ever behind a decision.

Each rank's engine resolves the plan on its own (seed 001: resolution never writes the plan), so
the ranks share nothing but the plan. The handle keeps every rank's own handle (`CopyHandle.ranks`):
a load's per-rank readiness follows it (`LayerReadiness.rank`). Storage I/O is fanned out by the
transfer actor (per-rank key lists, `SubmitStorage.rank_keys`), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from runtime.errors import ConfigError, TransferError
from runtime.messages import TransferPlan
from runtime.transfer.engine import CopyEngine, CopyHandle

__all__ = ["AllRanks", "ShardedCopyEngine", "pool_geometry"]


def pool_geometry(pools: Any) -> tuple:
    """What every rank's pools must agree on: per pool name, the page size, the page counts and the
    per-layer row geometry (the ranks' heads differ in content, never in shape)."""
    out = []
    for name, (device, host) in sorted(pools.items()):
        shape = device.shape
        out.append((name, device.page_size, device.num_pages, host.num_pages, shape.num_layers,
                    shape.token_elems, shape.itemsize, shape.parts))
    return tuple(out)


class AllRanks:
    """A `Completion` done when every rank's is; `synchronize` raises the first rank's failure."""

    __slots__ = ("_parts",)

    def __init__(self, parts: Sequence[Any]) -> None:
        self._parts = tuple(parts)

    def query(self) -> bool:
        return all(p.query() for p in self._parts)

    def synchronize(self) -> None:
        for rank, part in enumerate(self._parts):
            try:
                part.synchronize()
            except Exception as exc:
                raise TransferError(f"rank {rank}: {exc}") from exc


class ShardedCopyEngine:
    """The `CopyEngine` of one control plane over `engines[r]` (rank r's engine over its pools)."""

    def __init__(self, engines: Sequence[CopyEngine], geometries: Sequence[tuple]) -> None:
        """`geometries[r]`: `pool_geometry` of rank r's pools (ConfigError unless all equal)."""
        if not engines or len(engines) != len(geometries):
            raise ConfigError("a sharded engine needs one engine and one pool geometry per rank")
        if any(g != geometries[0] for g in geometries):
            raise ConfigError("every rank's pools must have one geometry (page size, pages, layers, row size)")
        self.engines = tuple(engines)

    @property
    def num_ranks(self) -> int:
        return len(self.engines)

    def submit(self, plan: TransferPlan) -> CopyHandle:
        # rank 0 validates first: the ranks' pools have one geometry, so a plan one accepts every
        # rank accepts, and a refused plan started nowhere
        handles = [engine.submit(plan) for engine in self.engines]
        layers = tuple(AllRanks(per_layer) for per_layer in zip(*(h.layers for h in handles), strict=True))
        return CopyHandle(plan.op_id, layers, AllRanks([h.done for h in handles]), None, tuple(handles))

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
