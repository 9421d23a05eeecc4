"""FileBackend: round trip, prefix existence, atomicity under a killed writer, a cap shared by
processes, LRU order; and the FaultyBackend wrapper over it."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch

from runtime.errors import ConfigError, StateError, ValidationError
from runtime.storage.backend import FaultPlan, FaultyBackend, StorageBackend, StorageError, read_prefix, write_pages
from runtime.storage.file_backend import TRAILER, FileBackend
from runtime.storage.integrity import PageSeal

PB = 4096  # page bytes for most tests


def key(i: int, tag: str = "k") -> bytes:
    return f"{tag}{i:06d}".encode().ljust(16, b".")


def page(i: int, nbytes: int = PB) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def files(root, suffix: str) -> list[str]:
    out = []
    for d, _subs, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if n.endswith(suffix)]
    return out


def dir_bytes(root, locked: bool = False) -> int:
    """Bytes of page and temporary files now in the directory tree.

    ``locked``: take the directory lock while counting, so that no writer reserves or evicts
    meanwhile (otherwise a file deleted behind the walk and another created ahead of it are both
    counted), and count a page once when a rename makes the walk see both its names (the
    callers write each key once)."""
    lock_fd = None
    if locked:
        lock_fd = os.open(os.path.join(root, ".hicache-state"), os.O_RDWR)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        sizes: dict[str, int] = {}
        for sub in os.scandir(root):
            if not sub.is_dir():
                continue
            for e in os.scandir(sub.path):
                name = e.name
                if name.endswith(".kv"):
                    hx = name[:-3]
                elif name.endswith(".tmp"):
                    hx = name.split(".")[1]
                else:
                    continue
                try:
                    sizes[hx] = max(sizes.get(hx, 0), e.stat().st_size)
                except FileNotFoundError:
                    pass
        return sum(sizes.values())
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


@pytest.fixture
def fb(tmp_path):
    b = FileBackend(tmp_path / "store", PB, touch_interval_s=0)
    yield b
    b.close()


def test_protocol_conformance(fb):
    assert isinstance(fb, StorageBackend)


def test_round_trip_numpy_bytes_torch(fb):
    keys = [key(i) for i in range(4)]
    srcs = [page(0), bytes(page(1)), memoryview(bytearray(page(2))),
            torch.from_numpy(page(3).copy()).view(torch.bfloat16).reshape(2, 2, 8, 64)]
    assert fb.set_batch(keys, srcs) == [True] * 4
    dests = [np.zeros(PB, np.uint8), bytearray(PB), torch.zeros(PB // 2, dtype=torch.bfloat16),
             torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16)]
    assert fb.get_batch(keys, dests) == [True] * 4
    assert np.array_equal(dests[0], page(0))
    assert bytes(dests[1]) == bytes(page(1))
    assert np.array_equal(dests[2].view(torch.uint8).numpy(), page(2))
    assert np.array_equal(dests[3].reshape(-1).view(torch.uint8).numpy(), page(3))
    s = fb.stats()
    assert s["pages_written"] == 4 and s["pages_read"] == 4 and s["used_bytes"] == 4 * fb.file_bytes


def test_prefix_existence_and_missing_pages(fb):
    keys = [key(i) for i in range(6)]
    assert fb.exists_prefix(keys) == 0
    fb.set_batch(keys[:3] + keys[4:5], [page(i) for i in (0, 1, 2, 4)])
    assert fb.exists_prefix(keys) == 3
    assert fb.exists_prefix(keys[4:]) == 1
    assert fb.exists_prefix([]) == 0
    dests = [np.zeros(PB, np.uint8) for _ in keys]
    assert fb.get_batch(keys, dests) == [True, True, True, False, True, False]
    assert fb.stats()["read_misses"] == 2
    # a page that vanishes between exists and get is a miss, not an error
    os.unlink(fb._path(keys[0])[2])
    assert fb.get_batch(keys[:1], dests[:1]) == [False]


def test_get_prefix_reads_the_leading_pages_in_one_pass(fb):
    keys = [key(i, "gp") for i in range(6)]
    fb.set_batch(keys[:3] + keys[4:5], [page(i) for i in (0, 1, 2, 4)])
    before = fb.stats()
    dests = [np.zeros(PB, np.uint8) for _ in keys]
    assert fb.get_prefix(keys, dests) == 3  # stops at the first missing page; page 4 is not read
    assert all(np.array_equal(dests[i], page(i)) for i in range(3)) and not dests[4].any()
    s = fb.stats()
    assert s["exists_calls"] == before["exists_calls"]  # no stat pass
    assert (s["get_calls"] - before["get_calls"], s["pages_read"] - before["pages_read"],
            s["read_misses"] - before["read_misses"]) == (1, 3, 1)
    assert fb.get_prefix(keys[3:], dests[3:]) == 0 and fb.get_prefix([], []) == 0
    # an unreadable page ends the prefix too (counted as a read error)
    with open(fb._path(keys[1])[2], "r+b") as f:
        f.truncate(PB)
    assert fb.get_prefix(keys, dests) == 1 and fb.stats()["read_errors"] == 1
    with pytest.raises(ValidationError):  # every buffer is checked before any I/O
        fb.get_prefix(keys[:2], [np.zeros(PB, np.uint8), bytes(PB)])
    # read_prefix: get_prefix when the backend has it, else exists_prefix + get_batch (pages written
    # with their tags: read_prefix checks them)
    seal = PageSeal()
    assert fb.remove(keys[:1]) == 1 and write_pages(fb, keys[:1], [page(0)], seal) == (True,)
    assert read_prefix(fb, keys, dests, seal) == 1
    wrapped = FaultyBackend(fb)
    assert wrapped.get_prefix is None and wrapped.exists_is_local is False  # its hooks are never bypassed
    assert read_prefix(wrapped, keys, dests, seal) == 1 and wrapped.calls == 2  # exists_prefix, then get_batch
    assert read_prefix(wrapped, keys[3:], dests[3:], seal) == 0 and wrapped.calls == 3  # nothing present: no get


def test_set_existing_and_duplicate_keys(fb):
    k = key(1)
    assert fb.set_batch([k, k], [page(1), page(1)]) == [True, True]
    assert fb.stats()["pages_written"] == 1
    assert fb.set_batch([k], [page(1)]) == [True]
    assert fb.stats()["pages_present"] == 1


def test_validation(fb, tmp_path):
    with pytest.raises(ValidationError):
        fb.set_batch([key(0)], [np.zeros(PB + 1, np.uint8)])
    with pytest.raises(ValidationError):
        fb.get_batch([key(0)], [bytes(PB)])  # read-only destination
    with pytest.raises(ValidationError):
        fb.get_batch([key(0)], [np.zeros((PB, 2), np.uint8)[:, 0]])  # not contiguous
    with pytest.raises(ValidationError):
        fb.set_batch([key(0), key(1)], [page(0)])
    with pytest.raises(ValidationError):
        fb.exists_prefix(["not-bytes"])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        FileBackend(tmp_path / "x", PB, cap_bytes=10)
    with pytest.raises(ConfigError):
        FileBackend(tmp_path / "x", PB, fsync="always")
    fb.close()
    with pytest.raises(StateError):
        fb.exists_prefix([key(0)])
    fb.close()  # idempotent


def test_remove_deletes_only_the_named_pages_and_gives_their_bytes_back(fb):
    keys = [key(i, "rm") for i in range(4)]
    assert fb.set_batch(keys, [page(i) for i in range(4)]) == [True] * 4
    assert fb.remove([keys[1], keys[3], keys[3], key(99, "rm")]) == 2  # a repeat and an absent key count 0
    assert fb.exists_prefix(keys) == 1 and fb.exists_prefix(keys[2:3]) == 1
    assert fb.used_bytes() == 2 * fb.file_bytes == dir_bytes(fb.directory)
    assert fb.stats()["removed_pages"] == 2
    assert fb.set_batch(keys[1:2], [page(1)]) == [True] and fb.exists_prefix(keys) == 3  # written again
    with pytest.raises(ValidationError):
        fb.remove([b""])
    fb.close()
    with pytest.raises(StateError):
        fb.remove(keys)


def test_two_instances_share_a_directory(tmp_path):
    a = FileBackend(tmp_path / "s", PB)
    b = FileBackend(tmp_path / "s", PB)
    a.set_batch([key(7)], [page(7)])
    d = np.zeros(PB, np.uint8)
    assert b.exists_prefix([key(7)]) == 1 and b.get_batch([key(7)], [d]) == [True]
    assert np.array_equal(d, page(7))
    a.close(); b.close()


@pytest.mark.parametrize("fsync", ["file", "dir"])
def test_fsync_policies_round_trip(tmp_path, fsync):
    b = FileBackend(tmp_path / "s", PB, fsync=fsync, cap_bytes=8 * (PB + TRAILER.size))
    assert b.set_batch([key(i) for i in range(3)], [page(i) for i in range(3)]) == [True] * 3
    d = np.zeros(PB, np.uint8)
    assert b.get_batch([key(2)], [d]) == [True] and np.array_equal(d, page(2))
    b.close()


# -- atomicity ---------------------------------------------------------------------------------

def test_partial_files_are_never_read(fb):
    k = key(3)
    _hx, d, final = fb._path(k)
    # a temporary file left by a writer is never read, even when complete
    tmp = os.path.join(d, f".{k.hex()}.999999.1.{fb.file_bytes}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"\0" * fb.file_bytes)
    assert fb.exists_prefix([k]) == 0
    assert fb.get_batch([k], [np.zeros(PB, np.uint8)]) == [False]
    # a truncated page file under the final name (a foreign writer, a crash without fsync)
    with open(final, "wb") as f:
        f.write(b"\1" * (fb.file_bytes // 2))
    assert fb.exists_prefix([k]) == 0
    assert fb.get_batch([k], [np.zeros(PB, np.uint8)]) == [False]
    # full size but a bad trailer (zero-filled after a machine crash); another key's content under
    # this name is read, and refused by the storage tier's check (tests/unit/storage/test_integrity.py)
    with open(final, "wb") as f:
        f.write(b"\0" * fb.file_bytes)
    assert fb.get_batch([k], [np.zeros(PB, np.uint8)]) == [False]
    assert fb.stats()["read_errors"] == 2
    # a scan removes the dead writer's temporary file (pid 999999 does not exist)
    fb.cleanup()
    assert not os.path.exists(tmp)


BIG = 32 << 20


def _writer(root: str, ready) -> None:
    b = FileBackend(root, BIG, cap_bytes=6 * (BIG + TRAILER.size), cleanup_on_open=False)
    src = np.empty(BIG, np.uint8)
    ready.set()
    for i in range(10_000):
        src[:] = i % 251
        b.set_batch([key(i)], [src])


def test_writer_killed_mid_write_leaves_no_readable_partial_page(tmp_path):
    root = str(tmp_path / "s")
    FileBackend(root, BIG).close()
    ctx = mp.get_context("fork")
    for attempt in range(3):
        ready = ctx.Event()
        p = ctx.Process(target=_writer, args=(root, ready))
        p.start()
        assert ready.wait(30)
        deadline = time.time() + 30
        caught = None
        while time.time() < deadline and caught is None:
            if len(files(root, ".kv")) < 2:  # let a few pages complete first
                continue
            for t in files(root, ".tmp"):
                try:
                    size = os.stat(t).st_size
                except FileNotFoundError:
                    continue
                if 0 < size < BIG:
                    caught = t
                    break
        p.kill()  # SIGKILL, mid-write when we caught a partial temporary file
        p.join()
        assert p.exitcode == -9
        if caught is not None and os.path.exists(caught):
            break
    reader = FileBackend(root, BIG, cleanup_on_open=False)
    dest = np.empty(BIG, np.uint8)
    assert files(root, ".tmp"), "expected the killed writer's temporary file"
    tmp_keys = {bytes.fromhex(os.path.basename(t).split(".")[1]) for t in files(root, ".tmp")}
    for t_key in tmp_keys:  # the page being written is not readable
        assert reader.exists_prefix([t_key]) == 0
        assert reader.get_batch([t_key], [dest]) == [False]
    complete = files(root, ".kv")
    assert len(complete) >= 2
    for f in complete:  # every readable page is whole and right
        k = bytes.fromhex(os.path.basename(f)[:-3])
        assert os.stat(f).st_size == reader.file_bytes
        if reader.get_batch([k], [dest]) == [True]:
            i = int(k.rstrip(b".")[1:])
            assert dest[0] == dest[-1] == i % 251 and (dest == i % 251).all()
    # the next scan removes the dead writer's leftovers and recounts the directory
    used = reader.cleanup()
    assert not files(root, ".tmp")
    assert used == dir_bytes(root)
    reader.close()


# -- the size cap and LRU ----------------------------------------------------------------------

def test_cap_evicts_least_recently_used(tmp_path):
    fb = FileBackend(tmp_path / "s", PB, cap_bytes=5 * (PB + TRAILER.size), evict_to=1.0, touch_interval_s=0)
    for i in range(5):
        assert fb.set_batch([key(i)], [page(i)]) == [True]
    assert fb.get_batch([key(0)], [np.zeros(PB, np.uint8)]) == [True]  # 0 is now the most recent
    assert fb.set_batch([key(5)], [page(5)]) == [True]
    present = [i for i in range(6) if fb.exists_prefix([key(i)])]
    assert present == [0, 2, 3, 4, 5]
    assert fb.set_batch([key(6)], [page(6)]) == [True]
    assert [i for i in range(7) if fb.exists_prefix([key(i)])] == [0, 3, 4, 5, 6]
    assert fb.stats()["evicted_pages"] == 2
    assert dir_bytes(tmp_path / "s") <= fb.cap_bytes
    fb.close()


def test_a_prefix_loses_its_tail_first(tmp_path):
    fb = FileBackend(tmp_path / "s", PB, cap_bytes=4 * (PB + TRAILER.size), evict_to=1.0, touch_interval_s=0)
    chain = [key(i, "c") for i in range(4)]
    fb.set_batch(chain, [page(i) for i in range(4)])
    fb.set_batch([key(9)], [page(9)])
    assert fb.exists_prefix(chain) == 3  # the last page of the chain went, the head stays
    fb.close()


def test_batch_larger_than_cap_stores_what_fits(tmp_path):
    fb = FileBackend(tmp_path / "s", PB, cap_bytes=3 * (PB + TRAILER.size))
    res = fb.set_batch([key(i) for i in range(5)], [page(i) for i in range(5)])
    assert res == [True, True, True, False, False]
    assert fb.stats()["write_no_room"] == 2
    assert dir_bytes(tmp_path / "s") <= fb.cap_bytes
    fb.close()


CAP_PAGES = 10
MP_PB = 64 << 10
N_MP = 150


def _cap_writer(root: str, tag: str, n: int, out) -> None:
    b = FileBackend(root, MP_PB, cap_bytes=CAP_PAGES * (MP_PB + TRAILER.size), touch_interval_s=0)
    ok = 0
    for start in range(0, n, 3):
        ks = [key(i, tag) for i in range(start, min(n, start + 3))]
        ok += sum(b.set_batch(ks, [page(i, MP_PB) for i in range(start, start + len(ks))]))
        d = np.zeros(MP_PB, np.uint8)
        b.get_batch(ks[:1], [d])
    out.put((tag, ok, b.stats()["evicted_pages"]))
    b.close()


def test_cap_holds_for_the_directory_across_processes(tmp_path):
    root = str(tmp_path / "s")
    cap = CAP_PAGES * (MP_PB + TRAILER.size)
    FileBackend(root, MP_PB, cap_bytes=cap).close()
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_cap_writer, args=(root, tag, N_MP, out)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    peak = samples = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, dir_bytes(root, locked=True))
        samples += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    results = sorted(out.get(timeout=5) for _ in procs)
    assert [r[1] for r in results] == [N_MP, N_MP]  # every write succeeded (by evicting)
    assert sum(r[2] for r in results) >= 2 * N_MP - CAP_PAGES  # both processes evicted
    assert samples > 20 and peak > cap // 2
    assert peak <= cap, (peak, cap, samples)
    assert dir_bytes(root) <= cap
    fb = FileBackend(root, MP_PB, cap_bytes=cap)
    assert fb.used_bytes() == dir_bytes(root)
    # what is left is readable and right
    for tag in ("a", "b"):
        for i in range(N_MP):
            d = np.zeros(MP_PB, np.uint8)
            if fb.get_batch([key(i, tag)], [d]) == [True]:
                assert np.array_equal(d, page(i, MP_PB))
    fb.close()


def test_threads_share_one_backend_under_a_cap(tmp_path):
    fb = FileBackend(tmp_path / "s", PB, cap_bytes=16 * (PB + TRAILER.size), touch_interval_s=0)
    errors = []

    def work(t: int) -> None:
        try:
            for i in range(40):
                k = key(i, f"t{t}")
                assert fb.set_batch([k], [page(1000 * t + i)]) == [True]
                d = np.zeros(PB, np.uint8)
                if fb.get_batch([k], [d]) == [True]:
                    assert np.array_equal(d, page(1000 * t + i))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert dir_bytes(tmp_path / "s") <= fb.cap_bytes
    assert fb.cleanup() == dir_bytes(tmp_path / "s")
    fb.close()


def test_files_of_an_older_format_are_misses(fb):
    """A page file of format v1 (32-byte trailer, magic HCKVPG01) or v2 (40-byte trailer, magic
    HCKVPG02: the backend's own checksum) is neither read, and a write of its key replaces it; v1
    has the current size, so only its magic tells it apart (checked by reading it)."""
    import struct

    for n, trailer in ((5, struct.pack("<8sQ16s", b"HCKVPG01", PB, bytes(16))),
                       (6, struct.pack("<8sQ16sQ", b"HCKVPG02", PB, bytes(16), 0))):
        k = key(n, "old")
        with open(fb._path(k)[2], "wb") as f:
            f.write(bytes(page(n)) + trailer)
        d = np.zeros(PB, np.uint8)
        assert fb.get_batch([k], [d]) == [False] and fb.get_prefix([k], [d]) == 0
        if len(trailer) != TRAILER.size:
            assert fb.exists_prefix([k]) == 0
            assert fb.set_batch([k], [page(n)]) == [True]  # rewritten
            assert fb.get_batch([k], [d]) == [True] and np.array_equal(d, page(n))


# -- fault injection ---------------------------------------------------------------------------

def test_faulty_backend_fails_reproducibly(fb):
    def run(plan: FaultPlan) -> list:
        fb2 = FaultyBackend(fb, plan)
        out = []
        for i in range(20):
            try:
                out.append(tuple(fb2.set_batch([key(i), key(i + 100)], [page(i), page(i + 100)])))
            except StorageError:
                out.append("err")
        return out

    plan = FaultPlan(fail_at={2, 5}, fail_rate=0.2, page_fail_rate=0.3, seed=7)
    a, b = run(plan), run(plan)
    assert a == b
    assert a[1] == "err" and a[4] == "err"
    assert any(r != "err" and not all(r) for r in a)  # some per-page failures
    c = run(FaultPlan(fail_at={2, 5}, fail_rate=0.2, page_fail_rate=0.3, seed=8))
    assert c != a


def test_faulty_backend_miss_mode_stall_and_hold(fb):
    fb.set_batch([key(1)], [page(1)])
    slept = []
    f = FaultyBackend(fb, FaultPlan(fail_at={1}, mode="miss", stall_at={2: 0.5}, hold_at={3}), sleep=slept.append)
    assert f.exists_prefix([key(1)]) == 0  # call 1: miss
    assert f.exists_prefix([key(1)]) == 1 and slept == [0.5]  # call 2: stalled then forwarded
    res = []
    t = threading.Thread(target=lambda: res.append(f.get_batch([key(1)], [np.zeros(PB, np.uint8)])))
    t.start()
    assert f.wait_held(1, timeout=5)
    assert res == []
    f.release()
    t.join(5)
    assert res == [[True]]
    assert f.stats()["faults"] == {"calls": 3, "failed": 1, "stalled": 1, "held": 1}
    assert f.file_bytes == fb.file_bytes  # other attributes pass through
