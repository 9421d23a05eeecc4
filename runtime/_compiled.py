"""Which hot modules run compiled, and the guard that never lets a stale build run.

The modules in `COMPILED` (the tree actor's synchronous core) may have a Cython-compiled twin
beside them (built by setup.py from the same .py, no Cython syntax). Python would import such
an extension in preference to the .py even after the .py was edited, so before any of them is
imported (this module runs first from `runtime/__init__.py`) each twin is checked against the
SHA-256 of its source that the build wrote beside it (`<name>.compiled-from`). A twin whose
source changed since, or that has no hash, is passed over: the .py is loaded in its place and a
`compiled_module_stale` warning names the rebuild command. `HICACHE_PURE_PYTHON=1` loads every
module from its .py (debuggers, profilers, comparing the two).

Imports only the standard library (and structlog for the warning): it runs before the rest of
the package exists.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

COMPILED: tuple[str, ...] = (
    "runtime.memory.owners",
    "runtime.memory.ledger",
    "runtime.tree.policies",
    "runtime.tree.nodes",
    "runtime.tree.radix",
    "runtime.tree.records",
    "runtime.tree.residency",
    "runtime.tree.copies",
    "runtime.tree.decode_offload",
    "runtime.tree.storage_tier",
    "runtime.tree.cache",
)

PURE_ENV = "HICACHE_PURE_PYTHON"
_PACKAGE_DIR = Path(__file__).resolve().parent

# module name -> "compiled" | "pure" (no twin built) | "pure: stale build" | "pure: HICACHE_PURE_PYTHON"
_status: dict[str, str] = {}


def status() -> dict[str, str]:
    """How each module of `COMPILED` was (or will be) loaded."""
    return dict(_status)


def _source_of(name: str) -> Path:
    return _PACKAGE_DIR.parent.joinpath(*name.split(".")).with_suffix(".py")


def _twin_of(source: Path) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        twin = source.with_suffix(suffix)
        if twin.exists():
            return twin
    return None


def _is_fresh(source: Path) -> bool:
    """The twin was compiled from exactly this source (per the hash its build wrote)."""
    stamp = source.with_suffix(".compiled-from")
    try:
        recorded = stamp.read_text().strip()
    except OSError:
        return False
    return recorded == hashlib.sha256(source.read_bytes()).hexdigest()


class _PreferSource:
    """A meta-path finder ahead of the default one: the .py spec for the modules it lists."""

    def __init__(self, use_source: dict[str, Path]) -> None:
        self.use_source = use_source

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        source = self.use_source.get(name)
        if source is None:
            return None
        loader = importlib.machinery.SourceFileLoader(name, str(source))
        return importlib.util.spec_from_file_location(name, source, loader=loader)


def install_guard() -> None:
    """Decide, for each module of `COMPILED`, compiled twin or .py; idempotent."""
    if _status:
        return
    force_pure = os.environ.get(PURE_ENV, "") not in ("", "0")
    use_source: dict[str, Path] = {}
    stale: list[str] = []
    for name in COMPILED:
        source = _source_of(name)
        twin = _twin_of(source)
        if twin is None:
            _status[name] = "pure"
        elif force_pure:
            _status[name] = f"pure: {PURE_ENV}"
            use_source[name] = source
        elif not source.exists() or _is_fresh(source):
            _status[name] = "compiled"  # (an installed wheel may ship the extension alone)
        else:
            _status[name] = "pure: stale build"
            use_source[name] = source
            stale.append(name)
    if use_source:
        sys.meta_path.insert(0, _PreferSource(use_source))
    if stale:
        import structlog

        structlog.get_logger("hicache.runtime").warning(
            "compiled_module_stale", modules=stale,
            fix="rebuild: scripts/setup.sh, or python setup.py build_ext --inplace")
