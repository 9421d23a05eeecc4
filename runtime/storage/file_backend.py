"""`FileBackend`: the embedded default storage tier, one file per page in a local directory.

Layout (``root`` is the directory; any number of processes may share it)::

    root/.hicache-state            24 bytes: magic, used bytes, scan epoch (flock'd to update)
    root/ab/<32 hex>.kv            one page: page_bytes of payload + a 32-byte trailer
    root/ab/.<hex>.<pid>.<nonce>.<size>.tmp   a write in progress (never read)

``ab`` is the first two hex digits of the key (256 fan-out directories).

Atomicity: a page is written to a temporary name in its final directory (optionally
fsync'd), then renamed onto ``<hex>.kv``; readers open only ``*.kv`` names, check the file
size and the trailer (magic, payload length), and `readinto` the destination (one ``preadv``
into the caller's buffer and the trailer; the payload starts at offset 0, so page-aligned
buffers get page-aligned copies).

Integrity: the trailer also holds the page's tag, which the storage tier computed from the host
pool's bytes and checks against the bytes it reads (`runtime.storage.integrity`); this backend
only stores it and hands it back. A page whose check fails is removed by the tier (`remove`),
so that it can be written again. The trailer's magic carries the format version: files of an
older version have another size or magic and read as misses. A writer killed at any point
leaves at most a ``.tmp`` file, which is never read and is deleted by the next scan once
its pid is dead (or it is older than ``stale_tmp_s``).

Size cap across processes: ``used`` in the state file counts the bytes of page files plus
a reservation of the full file size for every temporary file. A writer takes the directory
lock (``flock`` on the state file, plus a thread lock), reserves room for its batch, creates
the batch's temporary files, updates ``used`` and unlocks; the I/O happens outside the lock.
When a reservation does not fit, the writer rescans the directory under the lock (which
also repairs any drift: killed writers, concurrent writers of the same page, files removed
by hand) and deletes least-recently-used page files until ``used + need`` is at most
``evict_to * cap``. So the bytes of page and temporary files in the directory never exceed
the cap, whichever processes write, and the O(files) scan runs once per ``(1 - evict_to) *
cap`` bytes written. Readers never take the lock.

LRU clock: a file's mtime, set explicitly (ns) when written and touched on a hit (at most
once per ``touch_interval_s``). Within one batch the first page gets the newest stamp, so a
prefix loses its tail before its head.

Healing: a directory removed while open (``rm -rf``) is made again, with a fresh state file,
by the next write (``dir_recreated``, one ``storage_dir_recreated`` event); until then reads
and lookups miss. A fan-out directory removed alone is made again by the write that needs it.

Durability (``fsync``): ``"none"`` (default; a process crash never exposes a partial page,
a machine crash may lose recent pages), ``"file"`` (fsync each page before its rename),
``"dir"`` (also fsync the fan-out directories after the renames).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from runtime.errors import ConfigError, StateError
from runtime.storage.backend import (Buffer, CallGate, StorageError, byte_view, check_batch, check_keys, check_tags,
                                     gated)
from runtime.storage.integrity import TAG_BYTES
from runtime.storage.page_directory import PAGE_SUFFIX, TMP_SUFFIX, PageDirectory
from runtime.trace import get_logger

FSYNC_POLICIES = ("none", "file", "dir")
# magic (format version), payload length, the page's tag (the storage tier's; zeros: none given).
# v2 (HCKVPG02, 40 bytes: the backend's own checksum) files differ in size: they read as misses.
TRAILER = struct.Struct(f"<8sQ{TAG_BYTES}s")
TRAILER_MAGIC = b"HCKVPG03"

_log = get_logger("hicache.storage.file")


def directory_problem(path: str) -> str | None:
    """Why `path` cannot be a file backend's directory, or None: it must be a directory this
    process can write in, or be creatable as one (its nearest existing ancestor a writable
    directory). Nothing is created; the words follow the path in a message."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        return None if os.access(path, os.W_OK | os.X_OK) else "is a directory that is not writable"
    parent = os.path.dirname(os.path.normpath(path)) or "."
    while not os.path.exists(parent):  # makedirs creates the missing ones in the nearest existing one
        up = os.path.dirname(parent) or "."
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent!r} is not writable"
    return None


class FileBackend:
    """One file per page under ``directory``; see the module docstring for the format and rules."""

    # `exists_prefix` is a stat per key in a local directory: the transfer actor may probe the first
    # key on the event loop and answer a read of absent pages without a worker thread
    exists_is_local = True
    # its LRU stamps a chain's earlier pages newer: a chain is evicted from its tail
    evicts_tails_first = True
    # reads are local calls: `read_prefix` reads about a page at a time and checks each page's tag
    # while it is still in the CPU cache (runtime.storage.backend)
    read_chunk_bytes = 1 << 20

    def __init__(
        self,
        directory: str | os.PathLike[str],
        page_bytes: int,
        *,
        cap_bytes: int | None = None,
        fsync: str = "none",
        evict_to: float = 0.9,
        touch_interval_s: float = 1.0,
        stale_tmp_s: float = 600.0,
        cleanup_on_open: bool = True,
        close_timeout_s: float = 5.0,
    ) -> None:
        if not isinstance(page_bytes, int) or isinstance(page_bytes, bool) or page_bytes <= 0:
            raise ConfigError(f"page_bytes must be a positive int, got {page_bytes!r}")
        if fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not 0.0 < evict_to <= 1.0:
            raise ConfigError(f"evict_to must be in (0, 1], got {evict_to!r}")
        self.page_bytes = page_bytes
        self.file_bytes = page_bytes + TRAILER.size
        if cap_bytes is not None and (not isinstance(cap_bytes, int) or cap_bytes < self.file_bytes):
            raise ConfigError(f"cap_bytes must be None or >= one page file ({self.file_bytes} bytes), got {cap_bytes!r}")
        self.directory = os.fspath(directory)
        self.cap_bytes = cap_bytes
        self.fsync = fsync
        self.evict_to = evict_to
        self.touch_interval_ns = int(touch_interval_s * 1e9)
        self._dir = PageDirectory(self.directory, self.file_bytes, cap_bytes, evict_to, stale_tmp_s)
        self._fanout = self._dir.fanout  # by a key's first byte
        self._slock = threading.Lock()  # stats
        self._gate = CallGate("FileBackend")
        self.close_timeout_s = close_timeout_s
        self._nonce = 0
        self._s: dict[str, int] = dict.fromkeys((
            "exists_calls", "get_calls", "set_calls", "pages_read", "read_misses", "read_errors",
            "pages_written", "pages_present", "write_errors", "write_no_room", "bytes_read", "bytes_written",
            "removed_pages"), 0)
        if cleanup_on_open:
            self.cleanup()

    # -- paths -----------------------------------------------------------------------------------
    def _path(self, key: bytes) -> tuple[str, str, str]:
        hx = key.hex()
        d = self._fanout[key[0]]  # (joined once: two joins per page were a third of `exists_prefix`)
        return hx, d, f"{d}/{hx}{PAGE_SUFFIX}"

    def _count(self, **inc: int) -> None:
        with self._slock:
            for k, v in inc.items():
                self._s[k] += v

    @gated
    def cleanup(self) -> int:
        """Delete stale temporary files (killed writers) and recount ``used``. Returns ``used``."""
        return self._dir.recount()

    @gated
    def used_bytes(self) -> int:
        """The directory's accounted bytes (page files + in-flight reservations), as last recorded."""
        return self._dir.used_bytes()

    # -- protocol --------------------------------------------------------------------------------
    @gated
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._count(exists_calls=1)
        n = 0
        for key in keys:
            try:
                if os.stat(self._path(key)[2]).st_size != self.file_bytes:
                    break
            except OSError:
                # not a miss: something else stands where the storage was (a removed directory is
                # a miss: the next write makes it again)
                if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                    raise StorageError(f"storage directory {self.directory!r} is not a directory now") from None
                break
            n += 1
        return n

    @gated
    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        check_batch(keys, dests, "get_batch")
        views = [byte_view(d, self.page_bytes, writable=True) for d in dests]
        now = time.time_ns()
        n = len(keys)
        out = []
        hits = misses = errors = 0
        for i, (key, mv) in enumerate(zip(keys, views)):
            tag = self._read_one(key, mv, now + (n - i))
            out.append(isinstance(tag, bytes))
            if isinstance(tag, bytes):
                hits += 1
                if tags is not None:
                    tags[i] = tag
            elif tag == 0:
                misses += 1
            else:
                errors += 1
        self._count(get_calls=1, pages_read=hits, read_misses=misses, read_errors=errors,
                    bytes_read=hits * self.page_bytes)
        return out

    @gated
    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                   tags: list[bytes | None] | None = None) -> int:
        """Read the leading present pages into ``dests``, stopping at the first page that is missing
        or unreadable; returns how many were read whole. `exists_prefix` + `get_batch` in one pass
        (no stat pass; each page's size and trailer are checked as `get_batch` does)."""
        check_batch(keys, dests, "get_prefix")
        pb = self.page_bytes
        views = [byte_view(d, pb, writable=True) for d in dests]  # validate every buffer before any I/O
        now = time.time_ns()
        n = len(keys)
        hits = 0
        r: bytes | int = b""
        for i in range(n):
            r = self._read_one(keys[i], views[i], now + (n - i))
            if not isinstance(r, bytes):
                break
            if tags is not None:
                tags[i] = r
            hits += 1
        self._count(get_calls=1, pages_read=hits, read_misses=int(r == 0), read_errors=int(r == -1), bytes_read=hits * pb)
        return hits

    def _read_one(self, key: bytes, mv: memoryview, stamp_ns: int) -> bytes | int:
        """The page's tag (read), 0 (missing) or -1 (unreadable: wrong size or format version, I/O error)."""
        path = self._path(key)[2]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            _log.warning("storage_read_error", path=path, error=str(exc))
            return -1
        try:
            st = os.fstat(fd)
            if st.st_size != self.file_bytes:
                return -1
            trailer = bytearray(TRAILER.size)
            got = os.preadv(fd, [mv, trailer], 0)
            while got < self.file_bytes:  # short read: go on where it stopped
                if got < self.page_bytes:
                    more = os.preadv(fd, [mv[got:], trailer], got)
                else:
                    more = os.preadv(fd, [memoryview(trailer)[got - self.page_bytes:]], got)
                if more <= 0:
                    return -1
                got += more
            magic, length, tag = TRAILER.unpack(trailer)
            if magic != TRAILER_MAGIC or length != self.page_bytes:
                return -1
            if stamp_ns - st.st_mtime_ns > self.touch_interval_ns:
                try:
                    os.utime(fd, ns=(stamp_ns, stamp_ns))
                except OSError:
                    pass  # another user's file: LRU touch is best effort
            return tag
        except OSError as exc:
            _log.warning("storage_read_error", path=path, error=str(exc))
            return -1
        finally:
            os.close(fd)

    @gated
    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                  tags: Sequence[bytes] | None = None) -> list[bool]:
        check_batch(keys, srcs, "set_batch")
        tags = check_tags(tags, len(keys))
        views = [byte_view(s, self.page_bytes, writable=False) for s in srcs]
        n = len(keys)
        now = time.time_ns()
        result = [False] * n
        todo: list[tuple[int, bytes, str, str, str]] = []  # (index, key, hex, dir, final)
        seen: dict[bytes, int] = {}
        dup: list[tuple[int, int]] = []
        present = 0
        for i, key in enumerate(keys):
            key = bytes(key)
            if key in seen:
                dup.append((i, seen[key]))
                continue
            seen[key] = i
            hx, d, final = self._path(key)
            if self._stored_tag(final) == tags[i]:  # present: the same page (else replaced: corrupt, forged)
                result[i] = True
                present += 1
                try:
                    os.utime(final, ns=(now + (n - i), now + (n - i)))
                except OSError:
                    pass
                continue
            todo.append((i, key, hx, d, final))
        written = errors = no_room = 0
        if todo:
            self._dir.heal_if_removed()  # (removed under us: one stat per batch)
            temps, fit = self._dir.reserve(len(todo), lambda fit: self._create_temps(todo[:fit]))
            no_room = len(todo) - fit
            errors = fit - len(temps)  # (a temporary file that could not be made: a read-only directory)
            dirs: set[str] = set()
            filled = [(i, tmp, final) for (i, key, _hx, _d, final), (tmp, fd) in zip(todo, temps)
                      if self._write_one(tags[i], views[i], tmp, fd, now + (n - i))]
            renamed = self._rename_all(filled)
            for (i, _key, _hx, d, _final), (tmp, _fd) in zip(todo, temps):
                ok = tmp in renamed
                result[i] = ok
                if ok:
                    written += 1
                    dirs.add(d)
                else:
                    errors += 1
            if self.fsync == "dir":
                _fsync_dirs(dirs)
        for i, j in dup:
            result[i] = result[j]
        self._count(set_calls=1, pages_written=written, pages_present=present, write_errors=errors,
                    write_no_room=no_room, bytes_written=written * self.page_bytes)
        return result

    def _stored_tag(self, path: str) -> bytes | None:
        """The tag in the trailer of page file `path` (None: no such page file of this format)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != self.file_bytes:
                return None
            magic, length, tag = TRAILER.unpack(os.pread(fd, TRAILER.size, self.page_bytes))
            return tag if magic == TRAILER_MAGIC and length == self.page_bytes else None
        except (OSError, struct.error):
            return None
        finally:
            os.close(fd)

    def _create_temps(self, todo: list[tuple[int, bytes, str, str, str]]) -> list[tuple[str, int]]:
        temps: list[tuple[str, int]] = []
        pid = os.getpid()
        for _i, _key, hx, d, _final in todo:
            with self._slock:
                self._nonce += 1
                nonce = self._nonce
            tmp = os.path.join(d, f".{hx}.{pid}.{threading.get_ident() & 0xFFFFFF:x}{nonce:x}.{self.file_bytes}{TMP_SUFFIX}")
            try:
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileNotFoundError:  # its fan-out directory was removed alone
                    os.makedirs(d, exist_ok=True)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:  # (e.g. a read-only directory: counted as write errors)
                _log.debug("storage_tmp_create_error", path=tmp, error=str(exc))
                break
            temps.append((tmp, fd))
        return temps

    def _rename_all(self, filled: list[tuple[int, str, str]]) -> set[str]:
        """Rename written temporary files onto their page names, under the directory lock: a scan
        (also under it) never sees a page between its two names, so it never misses one and
        lets the directory outgrow its cap. Returns the temporary names renamed."""
        renamed: set[str] = set()
        failed: list[str] = []
        if filled:
            with self._dir.lock() as fd:
                replaced = 0  # bytes of page files a rename replaced (another page's, refused or older)
                for _i, tmp, final in filled:
                    try:
                        size = os.stat(final).st_size
                    except OSError:
                        size = 0
                    try:
                        os.rename(tmp, final)
                        renamed.add(tmp)
                        replaced += size
                    except OSError as exc:
                        _log.warning("storage_write_error", path=final, error=str(exc))
                        failed.append(tmp)
                self._dir.shrink(fd, replaced)
        for tmp in failed:
            self._drop_temp(tmp)
        return renamed

    def _write_one(self, tag: bytes, mv: memoryview, tmp: str, fd: int, stamp_ns: int) -> bool:
        """Fill temporary file ``tmp`` (open as ``fd``) with the page and its trailer; closes ``fd``."""
        try:
            try:
                trailer = TRAILER.pack(TRAILER_MAGIC, self.page_bytes, tag)
                done = os.writev(fd, [mv, trailer])
                while done < self.file_bytes:  # short write: go on where it stopped
                    if done < self.page_bytes:
                        done += os.writev(fd, [mv[done:], trailer])
                    else:
                        done += os.write(fd, trailer[done - self.page_bytes:])
                os.utime(fd, ns=(stamp_ns, stamp_ns))
                if self.fsync != "none":
                    os.fsync(fd)
            finally:
                os.close(fd)
            return True
        except OSError as exc:
            _log.warning("storage_write_error", path=tmp, error=str(exc))
            self._drop_temp(tmp)
            return False

    def _drop_temp(self, tmp: str) -> None:
        # Give the reservation back only if we removed the file ourselves: a scan that deleted it
        # as stale has already stopped counting it.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            return
        except OSError:
            return
        with self._dir.lock() as fd:
            self._dir.shrink(fd, self.file_bytes)

    @gated
    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete the page files of ``keys`` (`clear_storage`: a runtime removes the pages it knows it
        stored, never a file it cannot name); returns how many were there. Under the directory lock,
        so that ``used`` stays exact and a rename (also under it) is never half undone. A write of
        the same key by another process that lands after this stores the page again."""
        check_keys(keys)
        removed = freed = 0
        with self._dir.lock() as fd:
            for key in dict.fromkeys(bytes(k) for k in keys):
                path = self._path(key)[2]
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    _log.warning("storage_remove_error", path=path, error=str(exc))
                    continue
                removed += 1
                freed += size
            self._dir.shrink(fd, freed)
        self._count(removed_pages=removed)
        return removed

    def close(self) -> None:
        """No call starts any more; the directory's state descriptor is closed once the calls in
        flight have left (never under one: its number could be reused by another open), waiting at
        most ``close_timeout_s`` (`CallGate`)."""
        self._gate.close(self._dir.close, self.close_timeout_s)

    def stats(self) -> dict[str, Any]:
        with self._slock:
            s: dict[str, Any] = dict(self._s)
        s.update(self._dir.counts())
        s.update(backend="file", directory=self.directory, page_bytes=self.page_bytes,
                 file_bytes=self.file_bytes, cap_bytes=self.cap_bytes, fsync=self.fsync, **self._gate.stats())
        try:
            s["used_bytes"] = self.used_bytes()
        except StateError:  # closed
            pass
        return s

    def __enter__(self) -> "FileBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def _fsync_dirs(dirs: set[str]) -> None:
    for d in dirs:
        try:
            dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            _log.warning("storage_dir_fsync_error", dir=d, error=str(exc))
