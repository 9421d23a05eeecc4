"""vLLM 0.33's own `OffloadingConnector` on a CPU-only machine, for `bench_vllm_connector.py`.

The connector runs as vLLM ships it: its scheduler side (`OffloadingConnectorScheduler`, the
CPU tier's `CPUOffloadingManager`, or `TieringOffloadingManager` with its file-system tier and I/O
threads) unchanged. Only the copy engine is replaced: vLLM's (`vllm/v1/kv_offload/cpu/gpu_worker.py`)
needs CUDA or XPU streams; `CPUCopyWorker` copies whole pages between the paged KV tensors and the
CPU tier when a transfer is submitted and reports it done at the next `get_finished`. The specs
below are vLLM's own with that worker in place of theirs, loaded through vLLM's out-of-tree spec
hook (``spec_name`` + ``spec_module_path``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

CONNECTOR = "OffloadingConnector"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"


class CPUCopyWorker(OffloadingWorker):
    """Whole-page copies on the submitting thread; one offloaded chunk is one vLLM block
    (``block_size`` left at the GPU block size). `region`: the tiering spec's shared CPU region
    (its file-system tier reads and writes the same bytes), else private tensors."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int,
                 region: SharedOffloadRegion | None = None) -> None:
        if blocks_per_chunk != 1:
            raise ValueError("CPUCopyWorker copies one block per chunk (leave block_size at the GPU block size)")
        self.region = region
        self.device: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        for t in kv_caches.tensors:  # each (num_blocks, page bytes), int8, maybe strided
            device = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            host = (region.create_next_worker_view(t.page_size_bytes) if region is not None
                    else torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8))
            self.device.append(device)
            self.host.append(host)
        self.page_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, blocks: np.ndarray, chunks: np.ndarray, store: bool) -> bool:
        if len(blocks) != len(chunks):
            raise ValueError(f"job {job_id}: {len(blocks)} blocks for {len(chunks)} chunks")
        b, c = torch.from_numpy(blocks.astype(np.int64)), torch.from_numpy(chunks.astype(np.int64))
        for device, host in zip(self.device, self.host):
            if store:
                host[c] = device[b]
            else:
                device[b] = host[c]
        self._done.append(TransferResult(job_id, True, len(blocks) * self.page_bytes))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, store=True)  # type: ignore[attr-defined]

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        return self._copy(job_id, dst_spec.block_ids, src_spec.block_ids, store=False)  # type: ignore[attr-defined]

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Every transfer ran at its submit."""

    def shutdown(self) -> None:
        if self.region is not None:
            self.host = []  # (the region's views: released before it unmaps)
            self.region.cleanup()
            self.region = None


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU tier (`CPUOffloadingSpec`) with `CPUCopyWorker` as its copy engine."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


class CPUCopyTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's CPU tier with secondary tiers behind it (`TieringOffloadingSpec`) with `CPUCopyWorker`
    over the shared region its scheduler-side tiers read and write."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(engine_id=self._engine_id, num_chunks=self.num_chunks,
                                         rank=0 if self.replicated_layout else self.config.parallel.rank,
                                         kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                         cpu_page_size=self.cpu_page_size_per_worker)
            self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]


def extra_config(cpu_bytes: int, storage_dir: str | None = None, *, prompt_only: bool = False) -> dict[str, Any]:
    """`kv_connector_extra_config` for the native connector: a CPU tier of `cpu_bytes`, a file-system
    tier in `storage_dir` behind it if given. `prompt_only`: vLLM's default ``offload_prompt_only``
    (true: only prompt blocks are stored, a reply's are recomputed at the next turn); false stores
    every computed block, as the runtime's connector does."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": cpu_bytes, "offload_prompt_only": prompt_only,
                             "spec_module_path": __name__}
    if storage_dir is None:
        extra["spec_name"] = CPUCopyOffloadingSpec.__name__
    else:
        extra["spec_name"] = CPUCopyTieringOffloadingSpec.__name__
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": storage_dir}]
    return extra
