"""The compiled twins of the tree core (runtime/_compiled.py): never stale, same behaviour.

The suite itself runs whatever `scripts/setup.sh` built (the compiled twins where a C compiler
exists). These tests check that no stale twin is in use, that the guard passes over one whose
source changed, and that the same tree, ledger and lifecycle tests pass on the pure-Python
modules too (the two must not drift apart: Cython changes a few semantics, e.g. annotated
arguments are coerced unless `annotation_typing` is off; setup.py turns it off, and
tests/unit/memory/test_ledger.py::test_construction_rejects failed with it on).

Checked against a broken guard: with `_is_fresh` always True (an edited source's stale twin
kept), test_a_twin_whose_source_changed_is_passed_over fails on its first assertion.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import _compiled

ROOT = Path(__file__).resolve().parents[2]
BUILT = [name for name in _compiled.COMPILED if _compiled._twin_of(_compiled._source_of(name)) is not None]
needs_build = pytest.mark.skipif(not BUILT, reason="no compiled twin built here (no C compiler?)")

PROBE = ("import json, importlib; from runtime import _compiled; "
         "files = {m: importlib.import_module(m).__file__ for m in _compiled.COMPILED}; "
         "print(json.dumps({'status': _compiled.status(), 'files': files}))")


def _probe(pythonpath: Path, **env: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(pythonpath), **env}, cwd=pythonpath)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_stale_twin_in_this_run():
    import importlib

    for name in _compiled.COMPILED:
        module = importlib.import_module(name)
        if name in BUILT:
            assert _compiled.status()[name] == "compiled", f"{name}: {_compiled.status()[name]}; run scripts/setup.sh"
            assert not module.__file__.endswith(".py")
        else:
            assert module.__file__.endswith(".py")


@needs_build
def test_a_twin_whose_source_changed_is_passed_over(tmp_path):
    shutil.copytree(ROOT / "runtime", tmp_path / "runtime", ignore=shutil.ignore_patterns("__pycache__", "*.c"))
    edited = BUILT[-1]
    source = tmp_path.joinpath(*edited.split(".")).with_suffix(".py")
    source.write_text(source.read_text() + "\n# an edit after the build\n")
    seen = _probe(tmp_path)
    assert seen["status"][edited] == "pure: stale build"
    assert seen["files"][edited] == str(source)
    for name in BUILT[:-1]:
        assert seen["status"][name] == "compiled" and not seen["files"][name].endswith(".py")
    # a twin without a recorded hash is not trusted either
    stamp = tmp_path.joinpath(*BUILT[0].split(".")).with_suffix(".compiled-from")
    stamp.unlink()
    assert _probe(tmp_path)["status"][BUILT[0]] == "pure: stale build"


@needs_build
def test_pure_python_env_loads_every_source():
    seen = _probe(ROOT, **{_compiled.PURE_ENV: "1"})
    for name in _compiled.COMPILED:
        assert seen["files"][name].endswith(".py")
        assert seen["status"][name].startswith("pure")


@needs_build
def test_tree_ledger_and_lifecycle_tests_pass_as_pure_python():
    tests = ["tests/unit/tree", "tests/unit/memory", "tests/property", "tests/integration/test_lifecycle.py",
             "tests/integration/test_seed_002_004.py"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, _compiled.PURE_ENV: "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
