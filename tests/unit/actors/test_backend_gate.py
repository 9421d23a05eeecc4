"""BackendGate: calls in flight bounded, host pages of overdue ops bounded, the backend's health
from every call's outcome (a call past its deadline failed), probes while it is down."""

from __future__ import annotations

import asyncio

from runtime.actors.backend_gate import BackendGate
from runtime.messages import StorageHealthChanged, StorageProbe, SubmitStorage
from runtime.storage.health import Health, HealthPolicy


class Requester:
    def __init__(self) -> None:
        self.got: list[StorageHealthChanged] = []

    def put_internal(self, msg) -> None:
        self.got.append(msg)


def op(op_id: int, kind: str, to: Requester, pages: int = 2) -> SubmitStorage:
    keys = tuple(f"k{op_id}-{i}".encode() for i in range(pages))
    return SubmitStorage(op_id, kind == "write", keys, () if kind == "lookup" else tuple(range(pages)), to)


def gate(posted: list, **kw) -> BackendGate:
    kw.setdefault("max_inflight", 2)
    kw.setdefault("max_overdue_pages", 3)
    return BackendGate(posted.append, timeout_s=1.0, policy=HealthPolicy(down_after=3, backoff_s=0.05,
                                                                          max_backoff_s=0.2), **kw)


def test_no_more_calls_run_than_the_limit_and_a_call_still_waiting_at_its_deadline_is_skipped():
    to, g = Requester(), gate([])
    ops = [op(i, "read", to) for i in range(5)]
    assert [g.queue(m) for m in ops] == [True, True, False, False, False]
    assert g.running == 2 and list(g.startable()) == []
    assert g.expired(ops[3]) is True  # never started: skip it, nothing to wait for
    g.returned(ops[0], None)
    started = []
    for op_id in g.startable():  # (as the caller does: each one admitted before the next)
        started.append(op_id)
        assert g.admit(ops[op_id])
    assert started == [2] and g.running == 2 and list(g.waiting) == [4]


async def test_overdue_reads_and_writes_hold_their_pages_until_they_return_and_no_more_start_past_the_bound():
    to, g = Requester(), gate([], max_inflight=8)
    slow = op(1, "read", to, pages=3)
    assert g.queue(slow)
    assert g.expired(slow) is False  # running: overdue, a failed read, its 3 pages held
    assert (g.overdue_pages, g.health.state) == (3, Health.DEGRADED)
    assert not g.admit(op(2, "write", to)) and not g.admit(op(3, "read", to))
    assert g.admit(op(4, "lookup", to))  # a lookup holds no page
    g.returned(slow, None)  # its call came back at last: its pages are free to go
    assert g.overdue_pages == 0 and g.admit(op(5, "write", to))


async def test_calls_that_never_return_take_the_backend_down_then_a_probe_brings_it_back():
    posted: list = []
    to, g = Requester(), gate(posted, max_inflight=8)
    stuck = [op(i, "lookup", to) for i in range(3)]
    for m in stuck:
        assert g.queue(m)
        g.expired(m)
    assert g.health.state is Health.DOWN and to.got == [StorageHealthChanged("degraded", False),
                                                        StorageHealthChanged("down", True)]
    assert not g.admit(op(9, "lookup", to))  # down, no probe due yet: skipped
    await asyncio.sleep(0.1)  # the backoff passes: the gate's timer asks for a probe
    assert posted == [StorageProbe()]
    probe = g.probe()
    assert probe is not None and probe.ack_to is None and not probe.write and not probe.pages
    assert g.queue(probe)  # the probe goes through
    g.returned(probe, None)  # answered
    assert g.health.state is Health.HEALTHY and to.got[-1] == StorageHealthChanged("healthy", False)
    for m in stuck:  # their calls return late: no change, nothing counted twice
        g.returned(m, None)
    assert g.running == 0 and g.health.state is Health.HEALTHY and g.changes == 3


async def test_a_probe_in_flight_is_the_only_one():
    """While the probe's call runs, no other probe is asked for, however many ops are skipped
    meanwhile (a storm of probes, each skipped at once, was seen before this)."""
    posted: list = []
    to, g = Requester(), gate(posted, max_inflight=8)
    for i in range(3):
        m = op(i, "lookup", to)
        g.queue(m)
        g.expired(m)
    await asyncio.sleep(0.1)
    probe = g.probe()
    assert probe is not None and g.queue(probe)  # its call runs
    for i in range(10, 20):  # the requester's ops meanwhile: skipped, each asking for a probe
        assert not g.admit(op(i, "lookup", to))
        g.probe_later()
    await asyncio.sleep(0.3)
    assert posted == [StorageProbe()]  # the one that started the probe in flight: no other
