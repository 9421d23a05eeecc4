"""Shared benchmark helpers: git commit, medians, the final JSON line."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"


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
