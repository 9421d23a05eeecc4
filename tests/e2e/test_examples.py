"""Every script in examples/ runs to completion with short settings, so none can rot.

Each runs as a subprocess with ``--tiny --quick`` (scripts that take no options are run
bare; they say so with "Takes no options." in their docstring). A script whose listeners open on
every interface runs in its own test, in a private network namespace; it names that test in its
docstring ("Tested in a network namespace by ...").
"""

from __future__ import annotations

import ast
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trace_events import format_problems

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py")
                  if "Tested in a network namespace by" not in (ast.get_docstring(ast.parse(p.read_text())) or ""))
SHORT = ["--tiny", "--quick"]


def args_for(script: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    return [] if "Takes no options." in doc else SHORT


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"demo.py", "quickstart.py"} <= names


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", str(tmp_path))}
    args = list(args_for(script))  # (a copy: SHORT is shared by every script)
    if script.name == "demo.py":
        args += ["--trace", str(tmp_path / "trace.jsonl")]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if script.name == "demo.py":
        out = proc.stdout
        assert "turn 2]" in out and "restart:" in out and out.count("audit clean") == 2, out[-3000:]
        summary = re.search(r"^prompt tokens \d+: device (\d+) \| host (\d+) \| storage (\d+)", out, re.M)
        # device hits live, storage hits after the restart (the tiny run's host hits depend on timing)
        assert summary and int(summary[1]) > 0 and int(summary[3]) > 0, out[-3000:]
        assert "without reuse" in out and "= queue" in out, out[-3000:]
        assert (tmp_path / "trace.jsonl").stat().st_size > 0
        timeline = json.loads((tmp_path / "trace.timeline.json").read_text())
        assert {e["pid"] for e in timeline["traceEvents"]} == {1, 2}  # the live run and the restarted one
        assert format_problems(timeline) == []
