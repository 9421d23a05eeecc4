"""Shared benchmark helpers: git commit, medians, the final JSON line."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

# DeepSeek-V3's MLA cache (RuntimeConfig fields): 61 layers, per token one latent of kv_lora_rank
# 512 + qk_rope_head_dim 64, bf16 (70,272 B a token; an MHA model of this size would cache K and V
# of 128 heads). bench_transfer and bench_storage measure it beside their MHA shape.
DEEPSEEK_V3_MLA: dict[str, Any] = {"model_id": "deepseek-ai/DeepSeek-V3", "num_layers": 61, "num_kv_heads": 1,
                                   "head_dim": 576, "kv_dtype": "bfloat16", "kv_layout": "mla"}
# Bamba-9B's recurrent state (ibm-ai-platform/Bamba-9B config: 32 layers, attention at 9, 18, 27; Mamba2
# with 128 heads of 64, d_state 128, fp32 SSM state): per Mamba2 layer an SSM state of
# 128 x 64 x 128 fp32 = 4 MiB (98% of a state slot; the conv window, 8448 x 4 bf16, is the rest)
BAMBA_9B_SSM_STATE: dict[str, Any] = {"model_id": "ibm-ai-platform/Bamba-9B", "state_layers": 29,
                                      "ssm_state": (128, 64, 128), "dtype": "float32"}
# Bamba-9B's whole cache (RuntimeConfig fields): the KV of its 3 attention layers (8 KV heads of 128,
# bf16: 12,288 B a token) and its recurrent state, one slot of 29 Mamba2 layers (conv window
# 8448 x 4 bf16 + SSM state 128 x 64 x 128 fp32: 123,594,752 B, 158 chunks of a 64-token KV page). bench_storage measures it.
BAMBA_9B: dict[str, Any] = {"model_id": "ibm-ai-platform/Bamba-9B", "num_layers": 3, "num_kv_heads": 8, "head_dim": 128,
                            "kv_dtype": "bfloat16", "state_layers": 29,
                            "state_components": "conv:8448x4:bfloat16,ssm:128x64x128:float32"}


def git_commit() -> str:
    """The project's own commit (``-dirty`` with local changes), or "unknown" when the project
    directory is not itself a git checkout (a copy inside another repository would otherwise
    name that repository's commit)."""
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT.resolve():
            return "unknown"
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[idx]


def emit_json(record: dict[str, Any]) -> None:
    record.setdefault("torch_threads", torch.get_num_threads())
    record.setdefault("commit", git_commit())
    print(json.dumps(record, sort_keys=True))
