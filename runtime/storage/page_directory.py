"""`PageDirectory`: the shared accounting of a `FileBackend` directory (see its module docstring).

It owns the directory's state file (``used`` bytes and the scan epoch), the lock that guards it
(a thread lock plus ``flock``: one holder per directory across processes), the scans that recount
``used`` and delete stale temporary files, the LRU eviction that keeps the directory under its cap,
and the healing of a directory removed while open. `FileBackend` does the page I/O and asks this
part for room (`reserve`) and to give bytes back (`shrink`, under the lock it holds).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from runtime.trace import get_logger

STATE = struct.Struct("<8sqq")
STATE_MAGIC = b"HCSTATE1"
STATE_NAME = ".hicache-state"
PAGE_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
FANOUT = [f"{i:02x}" for i in range(256)]
COUNTERS = ("scans", "stale_tmp_removed", "evicted_pages", "evicted_bytes", "dir_recreated")

_log = get_logger("hicache.storage.file")
T = TypeVar("T")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PageDirectory:
    """The directory's fan-out folders, state file, lock, scans, eviction and healing."""

    def __init__(self, directory: str, file_bytes: int, cap_bytes: int | None, evict_to: float,
                 stale_tmp_s: float) -> None:
        self.directory = directory
        self.file_bytes = file_bytes
        self.cap_bytes = cap_bytes
        self.evict_to = evict_to
        self.stale_tmp_ns = int(stale_tmp_s * 1e9)
        self.fanout = [os.path.join(directory, sub) for sub in FANOUT]  # by a key's first byte
        self.make_dirs()
        self.state_path = os.path.join(directory, STATE_NAME)
        self._tlock = threading.Lock()
        self._clock = threading.Lock()  # counters
        self._pid = os.getpid()
        self.state_fd: int | None = os.open(self.state_path, os.O_RDWR | os.O_CREAT, 0o644)
        self._stale_fds: list[int] = []  # state files of a removed directory (closed at close())
        self.counters = dict.fromkeys(COUNTERS, 0)

    def _count(self, **inc: int) -> None:
        with self._clock:
            for k, v in inc.items():
                self.counters[k] += v

    def counts(self) -> dict[str, int]:
        with self._clock:
            return dict(self.counters)

    def make_dirs(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for sub in self.fanout:
            os.makedirs(sub, exist_ok=True)

    def heal_if_removed(self) -> None:
        """The directory was removed under us (one stat tells): make it again, with a fresh state
        file (the old one, unlinked, would keep this process's accounting apart from every other's)."""
        if os.path.exists(self.state_path):
            return
        self.make_dirs()
        with self._tlock:
            fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT, 0o644)
            if self.state_fd is not None and os.fstat(fd).st_ino == os.fstat(self.state_fd).st_ino:
                os.close(fd)  # (another writer made it again already, under the same file)
            else:
                if self.state_fd is not None:  # (a thread may be about to lock it: closed at close())
                    self._stale_fds.append(self.state_fd)
                self.state_fd = fd
        self._count(dir_recreated=1)
        _log.warning("storage_dir_recreated", directory=self.directory)

    # -- the lock and the state file --------------------------------------------------------------
    def fd(self) -> int:
        if self._pid != os.getpid():  # forked: our flock would be shared with the parent's
            self._pid = os.getpid()
            self._tlock = threading.Lock()
            self.state_fd = os.open(self.state_path, os.O_RDWR | os.O_CREAT, 0o644)
        assert self.state_fd is not None
        return self.state_fd

    @contextmanager
    def lock(self) -> Iterator[int]:
        """Thread lock + ``flock`` on the state file: one holder per directory across processes.
        Yields the state file's descriptor."""
        fd = self.fd()
        tlock = self._tlock
        with tlock:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    break
                except InterruptedError:
                    continue
                except OSError as exc:
                    if exc.errno != errno.EINTR:
                        raise
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def read_state(self, fd: int) -> tuple[int, int]:
        raw = os.pread(fd, STATE.size, 0)
        if len(raw) != STATE.size:
            return -1, 0
        magic, used, epoch = STATE.unpack(raw)
        if magic != STATE_MAGIC:
            return -1, 0
        return used, epoch

    def write_state(self, fd: int, used: int, epoch: int) -> None:
        os.pwrite(fd, STATE.pack(STATE_MAGIC, max(0, used), epoch), 0)

    def shrink(self, fd: int, freed: int) -> None:
        """Give ``freed`` bytes back to ``used`` (the caller holds the lock as ``fd``)."""
        if freed:
            used, epoch = self.read_state(fd)
            if used >= 0:
                self.write_state(fd, used - freed, epoch)

    def used_bytes(self) -> int:
        used, _ = self.read_state(self.fd())
        return max(used, 0)

    # -- scanning, room and eviction (under the lock) ---------------------------------------------
    def recount(self) -> int:
        """Delete stale temporary files and recount ``used`` (a new scan epoch). Returns ``used``."""
        with self.lock() as fd:
            used, _ = self._scan()
            _, epoch = self.read_state(fd)
            self.write_state(fd, used, epoch + 1)
        return used

    def reserve(self, pages: int, create: Callable[[int], list[T]]) -> tuple[list[T], int]:
        """How many of ``pages`` page files the cap lets in (`fit`), and what ``create(fit)`` made for
        them (temporary files), whose full size is then accounted in ``used``. Under the lock, with
        or without a cap, so that an uncapped writer never breaks the accounting of capped ones
        sharing the directory."""
        fb = self.file_bytes
        with self.lock() as fd:
            used, epoch = self.read_state(fd)
            need = pages * fb
            if used < 0:  # no valid state yet: count the directory
                used, _ = self._scan()
                epoch += 1
            if self.cap_bytes is None:
                fit = pages
            else:
                if used + need > self.cap_bytes:
                    used = self._make_room(used, need)
                    epoch += 1
                fit = max(0, min(pages, (self.cap_bytes - used) // fb))
            made = create(fit)
            self.write_state(fd, used + len(made) * fb, epoch)
        return made, fit

    def _scan(self) -> tuple[int, list[tuple[int, str, int]]]:
        """Bytes in use (page files + reservations of live temporary files) and the page files as
        ``(mtime_ns, path, size)``; deletes stale temporary files."""
        used = 0
        pages: list[tuple[int, str, int]] = []
        now = time.time_ns()
        removed = 0
        for sub in self.fanout:
            try:
                it = os.scandir(sub)
            except FileNotFoundError:
                continue
            with it:
                for e in it:
                    name = e.name
                    if name.endswith(PAGE_SUFFIX):
                        try:
                            st = e.stat()
                        except FileNotFoundError:
                            continue
                        used += st.st_size
                        pages.append((st.st_mtime_ns, e.path, st.st_size))
                    elif name.endswith(TMP_SUFFIX) and name.startswith("."):
                        size = self._live_tmp_size(e, now)
                        if size is None:
                            removed += 1
                        else:
                            used += size
        self._count(scans=1, stale_tmp_removed=removed)
        return used, pages

    def _live_tmp_size(self, e: os.DirEntry[str], now: int) -> int | None:
        """The reservation of a live temporary file (0: a name not ours to judge), or None after
        deleting a stale one (its writer is dead, or it is older than ``stale_tmp_s``)."""
        parts = e.name.split(".")  # ['', hex, pid, nonce, size, 'tmp']
        try:
            pid, size = int(parts[2]), int(parts[4])
            st = e.stat()
        except (ValueError, IndexError, FileNotFoundError):
            return 0
        stale = now - st.st_mtime_ns > self.stale_tmp_ns or (pid != os.getpid() and not _pid_alive(pid))
        if not stale:
            return size
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            return 0
        return None

    def _make_room(self, used: int, need: int) -> int:
        """Rescan and evict LRU page files until ``used + need <= evict_to * cap`` (or nothing is
        left to evict). Returns the new ``used``."""
        used, pages = self._scan()
        cap = self.cap_bytes
        assert cap is not None
        target = int(cap * self.evict_to)
        if used + need > target:
            pages.sort()
            evicted = evicted_bytes = 0
            for _mtime, path, size in pages:
                if used + need <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                used -= size
                evicted += 1
                evicted_bytes += size
            self._count(evicted_pages=evicted, evicted_bytes=evicted_bytes)
        return used

    def close(self) -> None:
        """Close the state file (the backend's `CallGate` calls this once no call is in flight)."""
        if self.state_fd is not None and self._pid == os.getpid():
            os.close(self.state_fd)
            for fd in self._stale_fds:
                os.close(fd)
        self.state_fd = None
        self._stale_fds = []

