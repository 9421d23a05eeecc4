"""The KV transports (runtime/disagg/transport.py): `LocalTransport`, the in-process stand-in
(scattered pages round trip, refusals that move nothing, its fault hooks, a closed peer), and
`MooncakeTransport` between two processes in a private network namespace (the Transfer Engine
listens on every interface: inside, there is only loopback). The Mooncake test skips only when
`mooncake.engine` is not installed, and fails when no namespace can be made."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runtime.disagg.transport import (
    KVTransport,
    LocalTransport,
    MooncakeTransport,
    TransportError,
)
from runtime.storage.backend import StorageError
from tests.netns import run_for_result

REPO = Path(__file__).resolve().parents[3]
PAGE = 4096


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def pair() -> Iterator[tuple[LocalTransport, LocalTransport, torch.Tensor, torch.Tensor]]:
    """A sender with 16 random pages registered, a receiver with 32 zero pages registered."""
    a, b = LocalTransport(), LocalTransport()
    src, dst = pattern(1, 16 * PAGE), torch.zeros(32 * PAGE, dtype=torch.uint8)
    a.register(src)
    b.register(dst)
    yield a, b, src, dst
    a.close()
    b.close()


def pages(t: torch.Tensor, idx: list[int]) -> list[int]:
    return [t.data_ptr() + i * PAGE for i in idx]


def test_both_transports_are_kv_transports(pair) -> None:
    a, _b, _src, _dst = pair
    assert isinstance(a, KVTransport)
    assert issubclass(TransportError, StorageError)
    assert all(hasattr(MooncakeTransport, m) for m in ("register", "unregister", "write", "close"))


def test_scattered_pages_round_trip(pair) -> None:
    a, b, src, dst = pair
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(2))[:16].tolist()
    a.write(b.session, pages(src, list(range(16))), pages(dst, slots), [PAGE] * 16)
    got = dst.view(32, PAGE)
    for i, slot in enumerate(slots):
        assert torch.equal(got[slot], src.view(16, PAGE)[i])
    untouched = sorted(set(range(32)) - set(slots))
    assert int(got[untouched].count_nonzero()) == 0
    # sub-page ranges and a write back the other way (the receiver registers nothing more)
    a.write(b.session, [src.data_ptr() + 5], [dst.data_ptr() + 7], [100])
    assert torch.equal(dst[7:107], src[5:105])
    b.write(a.session, [dst.data_ptr() + slots[3] * PAGE], [src.data_ptr()], [PAGE])
    assert torch.equal(src[:PAGE], src.view(16, PAGE)[3])
    a.write(b.session, [], [], [])  # an empty batch moves nothing and succeeds


def test_refusals_move_nothing(pair) -> None:
    a, b, src, dst = pair
    stray = pattern(3, PAGE)  # never registered
    with pytest.raises(TransportError, match="source 1"):
        a.write(b.session, [src.data_ptr(), stray.data_ptr()], pages(dst, [0, 1]), [PAGE, PAGE])
    with pytest.raises(TransportError, match="source 0"):  # runs past the end of the source buffer
        a.write(b.session, pages(src, [15]), pages(dst, [0]), [PAGE + 1])
    with pytest.raises(TransportError, match="destination 1"):  # past the end of the peer's buffer
        a.write(b.session, pages(src, [0, 1]), pages(dst, [0, 32]), [PAGE, PAGE])
    with pytest.raises(TransportError, match="destination 0"):  # the peer's memory, not registered there
        a.write(b.session, pages(src, [0]), [stray.data_ptr()], [PAGE])
    with pytest.raises(TransportError, match="no such peer"):
        a.write("local:nobody", pages(src, [0]), pages(dst, [0]), [PAGE])
    for args in (([src.data_ptr()], pages(dst, [0, 1]), [PAGE, PAGE]),  # unequal lists
                 ([src.data_ptr()], [dst.data_ptr()], [0]),  # empty range
                 ([src.data_ptr()], [dst.data_ptr()], [-1]),
                 ([src.data_ptr()], [dst.data_ptr()], [True]),
                 ([float(src.data_ptr())], [dst.data_ptr()], [PAGE])):
        with pytest.raises(ValueError):
            a.write(b.session, *args)
    with pytest.raises(ValueError):
        a.write("", pages(src, [0]), pages(dst, [0]), [PAGE])
    assert int(dst.count_nonzero()) == 0 and a.writes == 0
    b.unregister(dst)  # the peer takes its buffer back: writes into it are refused
    with pytest.raises(TransportError, match="destination 0"):
        a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    assert int(dst.count_nonzero()) == 0


def test_registration(pair) -> None:
    a, _b, src, _dst = pair
    a.register(src)  # again: no-op
    a.register(src.view(16, PAGE))  # the same memory seen as another shape: the same buffer
    with pytest.raises(ValueError, match="overlaps"):
        a.register(src[PAGE:])
    with pytest.raises(ValueError, match="contiguous"):
        a.register(torch.zeros(8, 8, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="at least one byte"):
        a.register(torch.zeros(0, dtype=torch.uint8))
    a.unregister(src)
    a.unregister(src)  # not registered: no-op
    with pytest.raises(TransportError, match="source 0"):
        a.write(a.session, pages(src, [0]), pages(src, [1]), [PAGE])
    with pytest.raises(ValueError, match="session"):
        LocalTransport(a.session)


def test_fail_next_fails_that_many_writes(pair) -> None:
    a, b, src, dst = pair
    a.fail_next = 2
    for _ in range(2):
        with pytest.raises(TransportError, match="injected"):
            a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    assert int(dst.count_nonzero()) == 0 and a.fail_next == 0
    a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    assert torch.equal(dst[:PAGE], src[:PAGE]) and a.writes == 1


def test_delay_and_a_peer_killed_during_it(pair) -> None:
    a, b, src, dst = pair
    a.delay_s = 0.05
    t0 = time.monotonic()
    a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    assert time.monotonic() - t0 >= 0.05
    dst.zero_()
    a.delay_s = 0.3
    killer = threading.Timer(0.05, setattr, (b, "closed", True))
    killer.start()
    with pytest.raises(TransportError, match="no such peer"):
        a.write(b.session, pages(src, [1]), pages(dst, [1]), [PAGE])
    killer.join()
    assert int(dst.count_nonzero()) == 0


def test_closed_endpoints(pair) -> None:
    a, b, src, dst = pair
    b.closed = True  # a killed peer
    with pytest.raises(TransportError, match="no such peer"):
        a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    b.closed = False
    a.write(b.session, pages(src, [0]), pages(dst, [0]), [PAGE])
    b.close()  # gone for good: its name is free again
    with pytest.raises(TransportError, match="no such peer"):
        a.write(b.session, pages(src, [1]), pages(dst, [1]), [PAGE])
    a.close()
    a.close()
    with pytest.raises(TransportError, match="closed"):
        a.write(b.session, pages(src, [1]), pages(dst, [1]), [PAGE])
    assert int(dst[PAGE:].count_nonzero()) == 0


def test_concurrent_writes(pair) -> None:
    a, b, src, dst = pair
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(50):
                a.write(b.session, pages(src, [k]), pages(dst, [k]), [PAGE])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and a.writes == 400
    assert torch.equal(dst[:8 * PAGE], src[:8 * PAGE])


# -- MooncakeTransport ---------------------------------------------------------------------------
def test_mooncake_arguments_checked_before_any_engine(monkeypatch) -> None:
    with pytest.raises(ValueError, match="not loopback"):
        MooncakeTransport("10.1.2.3")
    with pytest.raises(ValueError, match="timeout_s"):
        MooncakeTransport(timeout_s=1)
    for name in ("MC_FORCE_TCP", "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_LOG_LEVEL", "MC_TRANSFER_TIMEOUT",
                 "MC_TCP_BIND_ADDRESS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # an import of it fails
    with pytest.raises(StorageError, match="install_mooncake.sh"):
        MooncakeTransport()


RECEIVER = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    from runtime.disagg.transport import MooncakeTransport
    t = MooncakeTransport()
    buf = torch.zeros(int(sys.argv[1]), dtype=torch.uint8)
    t.register(buf)
    print(json.dumps({"session": t.session, "ptr": buf.data_ptr()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(hashlib.sha256(buf.numpy().tobytes()).hexdigest(), flush=True)
    t.close()
""")

SENDER = textwrap.dedent("""
    import hashlib, json, subprocess, sys, time
    import torch
    from runtime.disagg.transport import MooncakeTransport, TransportError
    PAGE, N, SLOTS = 4096, 64, 256
    rx = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(SLOTS * PAGE)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
    peer = json.loads(rx.stdout.readline())
    t = MooncakeTransport()
    src = torch.randint(0, 256, (N * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    t.register(src)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(8))[:N].tolist()
    t.write(peer["session"], [src.data_ptr() + i * PAGE for i in range(N)],
            [peer["ptr"] + s * PAGE for s in slots], [PAGE] * N)
    want = torch.zeros(SLOTS, PAGE, dtype=torch.uint8)
    want[slots] = src.view(N, PAGE)
    # 3000 pieces of 64 bytes, reversed: more items than one engine batch takes (1024)
    t.write(peer["session"], [src.data_ptr() + k * 64 for k in range(3000)],
            [peer["ptr"] + (2999 - k) * 64 for k in range(3000)], [64] * 3000)
    want = want.view(-1)
    want[:3000 * 64] = src[:3000 * 64].view(3000, 64).flip(0).reshape(-1)
    rx.stdin.write("digest\\n"); rx.stdin.flush()
    same = rx.stdout.readline().strip() == hashlib.sha256(want.numpy().tobytes()).hexdigest()
    rx.kill(); rx.wait()
    t0 = time.monotonic()
    try:
        t.write(peer["session"], [src.data_ptr()], [peer["ptr"]], [PAGE])
        error = None
    except TransportError as exc:
        error = str(exc)
    print("RESULT " + json.dumps({"same": same, "error": error, "error_s": time.monotonic() - t0}), flush=True)
    t.close()
""")


def test_mooncake_scattered_write_and_a_killed_peer() -> None:
    """A receiver process registers 256 pages; a sender writes 64 pages scattered over them, then
    3000 small pieces (three engine batches), the receiver's bytes checked whole; the receiver
    killed, the next write raises within 3 s."""
    pytest.importorskip("mooncake.engine", reason="Mooncake's Transfer Engine is not installed: "
                                                  "run scripts/install_mooncake.sh")
    r, where = run_for_result([sys.executable, "-c", SENDER, RECEIVER], env={"PYTHONPATH": str(REPO)}, cwd=str(REPO),
                              timeout=60)
    assert r["same"], where
    assert r["error"] is not None and "rc=-1" in r["error"] and r["error_s"] < 3.0, where
