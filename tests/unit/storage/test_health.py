"""HealthTracked: a storage backend's health from its calls' outcomes, and a down channel's calls
held back with backoff (a fake backend and a fake clock)."""

from __future__ import annotations

import pytest

from runtime.errors import ConfigError
from runtime.storage.health import Health, HealthPolicy, HealthTracked


class Fake:
    """A backend whose reads and writes fail on demand (`fail_reads`, `fail_writes`: raise;
    `refuse_writes`: store nothing, as a read-only directory)."""

    page_bytes = 8

    def __init__(self) -> None:
        self.fail_reads = self.fail_writes = self.refuse_writes = False
        self.calls: list[str] = []

    def exists_prefix(self, keys):
        self.calls.append("exists")
        if self.fail_reads:
            raise OSError("lookup failed")
        return len(keys)

    def get_batch(self, keys, dests, tags=None):
        self.calls.append("get")
        if self.fail_reads:
            raise OSError("read failed")
        return [True] * len(keys)

    def set_batch(self, keys, srcs, tags=None):
        self.calls.append("set")
        if self.fail_writes:
            raise OSError("write failed")
        return [not self.refuse_writes] * len(keys)

    def close(self) -> None:
        pass

    def stats(self):
        return {"backend": "fake"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tracked(policy: HealthPolicy | None = None):
    fake, clock, changes = Fake(), Clock(), []
    b = HealthTracked(fake, policy or HealthPolicy(down_after=3, backoff_s=1.0, max_backoff_s=4.0),
                      on_change=lambda old, new, why: changes.append((old, new)), clock=clock)
    return b, fake, clock, changes


def write(b, n: int = 2):
    return b.set_batch([b"k%d" % i for i in range(n)], [bytearray(8)] * n)


def test_a_failing_backend_degrades_goes_down_is_probed_with_backoff_and_recovers():
    b, fake, clock, changes = tracked()
    fake.fail_reads = fake.fail_writes = True
    for call in (lambda: write(b), lambda: b.get_batch([b"a"], [bytearray(8)])):
        for _ in range(3):
            with pytest.raises(OSError):
                call()
    assert b.state is Health.DOWN and changes == [(Health.HEALTHY, Health.DEGRADED), (Health.DEGRADED, Health.DOWN)]
    made = len(fake.calls)
    # down: calls are held back (a write stores nothing, a read reads nothing) until the backoff passed
    assert write(b) == [False, False] and b.get_batch([b"a"], [bytearray(8)]) == [False]
    assert len(fake.calls) == made and b.stats()["write_skipped"] == 1
    clock.now += 1.0
    with pytest.raises(OSError):  # the probe goes through, fails: the backoff doubles
        write(b)
    clock.now += 1.5
    assert write(b) == [False, False] and len(fake.calls) == made + 1
    clock.now += 0.5
    fake.fail_writes = False
    assert write(b) == [True, True]  # the probe succeeds: writes are back, reads still down
    assert b.state is Health.DEGRADED and changes[-1] == (Health.DOWN, Health.DEGRADED)
    clock.now += 1.0
    fake.fail_reads = False
    assert b.get_batch([b"a"], [bytearray(8)]) == [True]
    assert b.state is Health.HEALTHY and len(changes) == 4 and b.stats()["health_changes"] == 4


def test_a_read_only_directory_is_degraded_once_and_reads_keep_serving():
    """Writes that store nothing take the write channel down; reads keep serving; the state is
    degraded, reported once however many calls follow (no line per page or call)."""
    b, fake, clock, changes = tracked()
    fake.refuse_writes = True
    for _ in range(50):
        write(b)
        assert b.get_batch([b"a"], [bytearray(8)]) == [True] and b.exists_prefix([b"a", b"b"]) == 2
        clock.now += 0.3
    assert b.state is Health.DEGRADED and changes == [(Health.HEALTHY, Health.DEGRADED)]
    s = b.stats()
    assert s["health"] == "degraded" and s["write_failures"] >= 3 and s["write_skipped"] > 0
    assert s["read_failures"] == 0 and s["backend"] == "fake"


def test_a_write_that_stores_some_pages_is_no_failure():
    b, fake, _, changes = tracked()
    fake.set_batch = lambda keys, srcs, tags=None: [True] + [False] * (len(keys) - 1)  # (a cap: room for one)
    for _ in range(5):
        write(b, 3)
    assert b.state is Health.HEALTHY and not changes


@pytest.mark.parametrize("kwargs", [dict(down_after=0), dict(backoff_s=0.0), dict(backoff_s=5.0, max_backoff_s=1.0)])
def test_a_bad_policy_is_refused(kwargs):
    with pytest.raises(ConfigError):
        HealthPolicy(**kwargs)


def test_a_down_channel_whose_probe_fails_with_nothing_served_since_is_down():
    """Lookups fail (a dead master) while writes were last seen serving and are not called any
    more (every page stored already): once the lookups' probe fails too, with nothing served
    since they went down, the backend is down, not degraded; the next probe served: healthy."""
    b, fake, clock, changes = tracked()
    write(b)
    fake.fail_reads = True
    for _ in range(3):
        with pytest.raises(OSError):
            b.exists_prefix([b"a"])
    assert b.state is Health.DEGRADED
    clock.now += 1.0  # the backoff: a probe is due
    with pytest.raises(OSError):
        b.exists_prefix([b"a"])
    assert b.state is Health.DOWN
    fake.fail_reads = False
    clock.now += 2.0
    assert b.exists_prefix([b"a"]) == 1 and b.state is Health.HEALTHY
    assert [new for _old, new in changes] == [Health.DEGRADED, Health.DOWN, Health.HEALTHY]
