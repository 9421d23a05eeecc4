"""Build of the tree core's compiled twins (everything else is in pyproject.toml).

The modules in `runtime/_compiled.py: COMPILED` are plain Python, compiled as they are by
Cython (pure-Python mode, no Cython syntax) into extension modules that shadow them: the
same code without the interpreter's dispatch, about 1.2x the requests/s of the tree
benchmark. Each extension is optional: without Cython or a C compiler the install still
succeeds and the pure-Python modules run. Beside each extension the build writes the
SHA-256 of the source it was compiled from; `runtime/_compiled.py` loads the .py instead of
an extension whose source has changed since.

    python setup.py build_ext --inplace     # rebuild after editing one of them (scripts/setup.sh does)
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _compiled_modules() -> tuple[str, ...]:
    # runtime/_compiled.py is the one list; loaded by path (the package is not installed yet)
    spec = importlib.util.spec_from_file_location("_hicache_compiled", ROOT / "runtime" / "_compiled.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.COMPILED


class BuildExtWithSourceHash(build_ext):
    """build_ext that writes, beside each extension it (re)builds, the hash of its source,
    and copies that hash along with the extension on an in-place build."""

    def build_extension(self, ext) -> None:
        built = Path(self.get_ext_fullpath(ext.name))  # in the build directory (see run)
        source = ROOT / (ext.name.replace(".", "/") + ".py")
        digest = hashlib.sha256(source.read_bytes()).hexdigest()  # the source being compiled
        if built.exists() and not _stamp_of(built).exists():
            built.unlink()  # built with no hash beside it: its source is unknown, so rebuild
        before = built.stat().st_mtime_ns if built.exists() else None
        super().build_extension(ext)
        # an up-to-date extension is skipped and keeps the hash written when it was built
        if built.exists() and built.stat().st_mtime_ns != before:
            _stamp_of(built).write_text(digest + "\n")

    def run(self) -> None:
        super().run()  # builds in the build directory, then (--inplace) copies into the sources
        if self.inplace:  # the hashes go with the extensions
            for ext in self.extensions:
                target = _stamp_of(Path(self.get_ext_fullpath(ext.name)))
                self.inplace = False
                stamp = _stamp_of(Path(self.get_ext_fullpath(ext.name)))
                self.inplace = True
                if stamp.exists():
                    target.write_text(stamp.read_text())
                else:
                    target.unlink(missing_ok=True)


def _stamp_of(extension: Path) -> Path:
    """radix.cpython-311-x86_64-linux-gnu.so -> radix.compiled-from (read by runtime/_compiled.py)"""
    return extension.with_name(extension.name.split(".", 1)[0] + ".compiled-from")


def _extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError:  # no Cython: the pure-Python modules run
        return []
    exts = cythonize(
        [f"{name.replace('.', '/')}.py" for name in _compiled_modules()],
        # annotation_typing off: an `x: int` argument must not turn into a C-level coercion
        # (the ledger rejects 16.0 or True where it wants a count; compiled code must too)
        compiler_directives={"language_level": 3, "annotation_typing": False, "binding": True},
        quiet=True,
    )
    for ext in exts:
        ext.optional = True  # a failed compile leaves the pure-Python module in use
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExtWithSourceHash})
