"""BackendGate: whether a storage op's backend call may start now (a part of `StorageCalls`).

A storage backend can slow down, fail or stop answering (a Mooncake master killed, a directory
unmounted). Three rules keep an outage from piling up in the runtime:

- At most `max_inflight` calls run at once, overdue ones included: more wait here, in order; one
  still waiting at its deadline is skipped (it never reached the backend: nothing to wait for).
- Overdue reads and writes keep their host pages until their calls return (the backend may still
  move them): once they hold `max_overdue_pages`, no read or write starts (lookups hold none).
- The backend's health (`runtime.storage.health`, the same tracker the vLLM connector uses), fed
  by every call's outcome, a call past its deadline counting as failed: a down channel's calls
  are skipped; while the backend is down the requester is told to start none, and the gate
  probes it (one lookup, with backoff) until it answers again.
- A backend that can tell cheaply whether it is there at all (`reachable()`: Mooncake connects to
  its master) is asked when calls have run `WATCH_S` (or half the deadline): not there, it is down
  at once and the calls running are overdue now (their waiters go on; their pages stay held until
  they return), instead of a deadline or a client's own retries later.

A skipped op is acked at once as skipped (`StorageAck.skipped`): it says nothing of what storage
holds. The state goes to the requester as `StorageHealthChanged`, once per change.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from runtime.messages import StorageHealthChanged, StorageProbe, StorageWatch, SubmitStorage
from runtime.storage.health import Health, HealthPolicy, HealthTracker, log_change
from runtime.trace import get_logger

log = get_logger("hicache.transfer")

# calls running this long with none returned: ask the backend whether it is there at all
WATCH_S = 0.25


def channel_of(msg: SubmitStorage) -> str:
    """The health channel of a storage op: a write, a read (host pages to fill) or a lookup."""
    return "write" if msg.write else "read" if msg.pages else "lookup"


class BackendGate:
    # -- state -------------------------------------------------------------------
    def __init__(self, post: Callable[[Any], None], *, timeout_s: float, max_inflight: int, max_overdue_pages: int,
                 policy: HealthPolicy | None = None) -> None:
        """`post`: a message into the transfer actor's mailbox (its probe timer's); `timeout_s`: a
        call's deadline (`storage_timeout_s`)."""
        self._post = post
        self.timeout_s = timeout_s
        self.max_inflight = max_inflight
        self.max_overdue_pages = max_overdue_pages
        self.health = HealthTracker(policy, on_change=self._changed)
        self.waiting: dict[int, None] = {}  # op ids submitted, not started (in order)
        self.running = 0  # calls in worker threads (overdue ones included)
        self.overdue: dict[int, int] = {}  # op id -> host pages it holds, until its call returns
        self.requester: Any = None  # who issues the ops (the tree actor's mailbox): told of changes
        self.probe_key: bytes | None = None  # a key to look up when probing (the last one asked for)
        # the probe's timer while the backend is down; the watch's while calls run (None: its
        # reachability check is running), for a backend offering `reachable()`
        self._timers: dict[str, asyncio.TimerHandle | None] = {}
        self.changes = 0  # of the health, over every backend attached (a counter: it only grows)
        self.probe_ids = itertools.count(-1, -1)  # (negative: never a requester's op id)

    # -- ops ---------------------------------------------------------------------
    def queue(self, msg: SubmitStorage) -> bool:
        """A new op: True when its call starts now (`admit`ted: nothing waits before it, a call is
        free); else it waits (`startable`), or is refused and skipped at once (`admit`)."""
        if msg.ack_to is not None:
            self.requester = msg.ack_to
            if msg.keys:
                self.probe_key = msg.keys[0]
        if not self.waiting and self.running < self.max_inflight:
            return self.admit(msg)
        self.waiting[msg.op_id] = None
        return False

    def startable(self) -> Iterator[int]:
        """The waiting ops that may start now, in order (each then `admit`ted or skipped)."""
        while self.waiting and self.running < self.max_inflight:
            op_id = next(iter(self.waiting))
            del self.waiting[op_id]
            yield op_id

    def admit(self, msg: SubmitStorage) -> bool:
        """Whether `msg`'s call starts now (False: skip it): its channel not down (or its probe due),
        and, for a read or write, overdue ops not holding `max_overdue_pages` host pages."""
        if self.health.state is Health.HEALTHY and not self.overdue:  # (the common case)
            self.running += 1
            return True
        if msg.pages and self.overdue and self.overdue_pages >= self.max_overdue_pages:
            return False
        if not self.health.begin(channel_of(msg)):
            return False
        self.running += 1
        return True

    def returned(self, msg: SubmitStorage, error: str | None) -> None:
        """`msg`'s call returned (`error`: why it counts as failed, else None). An overdue one was
        counted failed at its deadline; now its host pages are free to go."""
        self.running -= 1
        if self.overdue and self.overdue.pop(msg.op_id, None) is not None:
            pass  # (counted failed at its deadline; its host pages are free to go now)
        elif error is not None or self.health.state is not Health.HEALTHY:  # (healthy and served: nothing changes)
            self.health.settle(channel_of(msg), error)
            self.probe_later()

    def expired(self, msg: SubmitStorage) -> bool:
        """`msg` reached its deadline: True when it never started (skip it); else it is overdue, a
        failed call for its channel, its host pages held until it returns."""
        if msg.op_id in self.waiting:
            del self.waiting[msg.op_id]
            return True
        self.overdue[msg.op_id] = len(msg.pages)
        self.health.settle(channel_of(msg), f"no answer in {self.timeout_s} s")
        self.probe_later()
        return False

    @property
    def overdue_pages(self) -> int:
        """Host pages the overdue ops hold (at most `max_inflight` ops: summed when asked)."""
        return sum(self.overdue.values())

    # -- probes --------------------------------------------------------------------
    def probe(self) -> SubmitStorage | None:
        """The probe timer fired: a lookup to send while the backend is down (None: not down now)."""
        self._timers.pop("probe", None)
        if self.health.state is not Health.DOWN or self.probe_key is None:
            return None
        return SubmitStorage(next(self.probe_ids), False, (self.probe_key,), (), None)

    def probe_later(self) -> None:
        """While the backend is down, the next probe's timer (one at a time): after a probe came
        back, went overdue, or could not be made (all calls taken by overdue ones, or not due)."""
        if "probe" in self._timers or self.health.state is not Health.DOWN:
            return
        delay = self.health.next_probe_in()
        if delay is not None:
            self._timers["probe"] = asyncio.get_running_loop().call_later(delay, self._post, StorageProbe())

    # -- the watch: is the backend still there? --------------------------------------------
    def watch_later(self) -> None:
        """A call started: the watch's timer, if none is armed (`WATCH_S`, or half the deadline)."""
        if "watch" not in self._timers and self.health.state is not Health.DOWN:
            delay = min(WATCH_S, self.timeout_s / 2)
            self._timers["watch"] = asyncio.get_running_loop().call_later(delay, self._post, StorageWatch())

    def watching(self) -> None:
        """The watch's check runs (no other starts meanwhile)."""
        self._timers["watch"] = None

    def watched(self) -> None:
        """The watch ended (nothing to ask, or answered): again later while calls still run."""
        self._timers.pop("watch", None)
        if self.running > len(self.overdue):
            self.watch_later()
    def _changed(self, old: Health, new: Health, reason: str) -> None:
        self.changes += 1
        log_change(old, new, reason)
        if self.requester is not None:
            try:
                self.requester.put_internal(StorageHealthChanged(new.value, new is Health.DOWN))
            except Exception:  # noqa: BLE001 - the requester stopped: nobody issues ops any more
                pass

    # -- lifecycle ---------------------------------------------------------------------
    def reset(self) -> None:
        """Another backend (attach / detach, nothing in flight): its health starts afresh."""
        self.stop()
        old = self.health.state
        self.health = HealthTracker(self.health.policy, on_change=self._changed)
        if old is not Health.HEALTHY:
            self._changed(old, Health.HEALTHY, "backend replaced")

    def stop(self) -> None:
        for timer in self._timers.values():
            if timer is not None:
                timer.cancel()
        self._timers.clear()

    def stats(self, host_page_bytes: int) -> dict[str, Any]:
        health = self.health.stats()
        return {"health": health["health"], "health_level": health["health_level"],
                "health_seconds": health["health_seconds"], "health_changes": self.changes,
                "storage_calls_running": self.running, "storage_calls_waiting": len(self.waiting),
                "storage_overdue_ops": len(self.overdue), "storage_overdue_host_pages": self.overdue_pages,
                "storage_overdue_host_bytes": self.overdue_pages * host_page_bytes}
