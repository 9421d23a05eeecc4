"""Helpers shared by the end-to-end tests (the fixtures ``model``/``ref_model`` are in conftest.py).

Import it only after ``pytest.importorskip("transformers")``: it uses the Hugging Face adapter.
"""

from __future__ import annotations

import os

import torch

from runtime.config import RuntimeConfig
from runtime.integrations.hf_llama import kv_geometry

TOL = 1e-5  # max abs logit difference from transformers' own forward (fp32)
PAGE = 16
# the model's and the device pool's torch device: HICACHE_TEST_DEVICE=cuda runs the end-to-end
# tests on a GPU, the CUDA copy engine moving the KV (docs/TESTING.md)
DEVICE = os.environ.get("HICACHE_TEST_DEVICE", "cpu")


def runtime_config(model, *, device_slots: int, **kw) -> RuntimeConfig:
    """A RuntimeConfig with the model's KV geometry: pages of PAGE, ``device_slots`` device slots,
    2048 host tokens, write-through and invariant checks on; ``kw`` overrides any of them."""
    layers, kv_heads, head_dim = kv_geometry(model.config)
    base = dict(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, page_size=PAGE, device=DEVICE,
                device_slots=device_slots, host_tokens=2048, write_policy="write_through", debug_invariants=True)
    base.update(kw)
    return RuntimeConfig(**base)


def ids(n: int, seed: int) -> list[int]:
    """n token ids in [3, 512), deterministic in seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def batch_or_singly(adapter, batch: list, *, batched: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(last logits [B, vocab], all logits per sequence)`` of ``batch`` through a paged adapter
    (``PagedKVModel``, ``PagedHybridModel``): one forward, or one forward per sequence."""
    if batched:
        out = adapter(batch, return_all_logits=True)
        return out.logits, out.all_logits
    outs = [adapter([s], return_all_logits=True) for s in batch]
    return torch.cat([o.logits for o in outs]), [o.all_logits[0] for o in outs]
