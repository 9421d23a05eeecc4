"""FileBackend heals: a directory removed while open is made again by the next write, and a
read-only directory counts its failed writes while reads keep serving."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

import numpy as np

from runtime.storage.file_backend import FileBackend

PB = 4096


def key(i: int) -> bytes:
    return f"k{i:06d}".encode().ljust(16, b".")


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PB, dtype=np.uint8)


def read(b: FileBackend, keys: list[bytes]) -> list[bool]:
    return b.get_batch(keys, [np.empty(PB, dtype=np.uint8) for _ in keys])


@contextlib.contextmanager
def read_only(root, monkeypatch):
    """`root` read-only: by its mode bits, or, as root (whom mode bits do not stop), by refusing to
    create files under it as a read-only file system does."""
    if os.geteuid() != 0:
        dirs = [d for d, _, _ in os.walk(root)]
        for d in dirs:
            os.chmod(d, 0o555)
        try:
            yield
        finally:
            for d in dirs:
                os.chmod(d, 0o755)
        return
    real_open, prefix = os.open, os.path.join(str(root), "")

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and os.fspath(path).startswith(prefix):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "open", refusing)
        yield


def test_a_removed_directory_is_made_again_by_the_next_write(tmp_path):
    """Checked failing with the heal off (`_heal` a no-op): the write re-makes its fan-out
    directory and stores the pages, but accounts them in the removed state file (used bytes 6
    pages, the removed ones counted; a second instance would account apart)."""
    root = tmp_path / "kv"
    b = FileBackend(root, PB)
    assert all(b.set_batch([key(i) for i in range(3)], [page(i) for i in range(3)]))
    shutil.rmtree(root)
    assert b.exists_prefix([key(0)]) == 0 and read(b, [key(0)]) == [False]  # gone: misses, no error
    assert all(b.set_batch([key(i) for i in range(3, 6)], [page(i) for i in range(3, 6)]))
    assert b.exists_prefix([key(3), key(4), key(5)]) == 3
    got = np.empty(PB, dtype=np.uint8)
    assert b.get_batch([key(4)], [got]) == [True] and np.array_equal(got, page(4))
    s = b.stats()
    assert s["dir_recreated"] == 1 and s["write_errors"] == 0 and s["used_bytes"] == 3 * b.file_bytes
    # a second instance on the directory shares the new state file (one accounting)
    other = FileBackend(root, PB)
    assert all(other.set_batch([key(9)], [page(9)])) and b.used_bytes() == 4 * b.file_bytes
    shutil.rmtree(root / key(7).hex()[:2])  # a fan-out directory removed alone
    assert all(b.set_batch([key(7)], [page(7)])) and read(b, [key(7)]) == [True]
    other.close()
    b.close()


def test_a_read_only_directory_counts_its_failed_writes_and_reads_keep_serving(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    b = FileBackend(root, PB)
    assert all(b.set_batch([key(i) for i in range(2)], [page(i) for i in range(2)]))
    with read_only(root, monkeypatch):
        assert b.set_batch([key(i) for i in range(2, 5)], [page(i) for i in range(2, 5)]) == [False] * 3
        assert read(b, [key(0), key(1)]) == [True, True] and b.exists_prefix([key(0), key(1)]) == 2
    s = b.stats()
    assert s["write_errors"] == 3 and s["write_no_room"] == 0 and s["pages_written"] == 2
    b.close()
