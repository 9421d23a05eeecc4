"""scripts/gpu_check.sh in its CPU mode (`--cpu-dry-run`): every step but the install runs on CPU
with tiny sizes and the summary says so, so that the GPU check cannot rot between GPU machines.
(Checked to fail: with serving sizes whose prompts exceed the device pool, the serving step fails,
the summary says `ok: false` and this test fails.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_writes_its_summary(tmp_path):
    pytest.importorskip("transformers")
    summary = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env.pop("OUT", None)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-dry-run", str(summary)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(summary.read_text())
    steps = {s["step"]: s for s in d["steps"]}
    assert d["mode"] == "cpu" and d["ok"], json.dumps(d, indent=1)[:3000]
    assert list(steps) == ["install", "gpu_tests", "transfer", "e2e", "serving", "load_latency", "serving_8b"]
    assert steps["install"]["status"] == "skipped"  # never installs anything on CPU
    assert steps["serving_8b"]["status"] == "skipped"  # (the 8B-size model needs a GPU)
    assert all(steps[s]["status"] == "ok" and 0 < steps[s]["seconds"] <= steps[s]["timeout_s"]
               for s in ("gpu_tests", "transfer", "e2e", "serving", "load_latency"))
    assert [(r["tokens"], r["scenario"]) for r in steps["load_latency"]["result"]["rows"]] == [(64, "idle"), (64, "busy")]
    # the project's own commit, or "unknown" where the project directory is no git checkout of its own
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    own = top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT.resolve()
    assert (d["commit"] != "unknown") == own
    assert steps["transfer"]["result"]["results"] and steps["serving"]["result"]["device"] == "cpu"
    assert [r["config"] for r in steps["serving"]["result"]["rows"]] == ["no_reuse", "device_host"]
    assert "passed" in steps["e2e"]["tail"] and "skipped" in steps["gpu_tests"]["tail"]
