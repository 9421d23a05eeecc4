"""A storage backend's health (healthy / degraded / down), tracked from the outcomes of its calls.

`HealthTracked` wraps any `StorageBackend`. Its calls fall in three channels: lookups
(`exists_prefix`), reads (`get_batch`, `get_prefix`) and writes (`set_batch`). A call fails when it
raises, or, for a write, when it stored none of its pages; a miss is no failure (pages come and
go). A channel whose last `down_after` calls failed is down: its calls are not made (a lookup
answers 0 pages, a read reads none, a write stores none: what a failed call would give) until its
backoff has passed, when one call goes through to probe it; the backoff doubles, up to
`max_backoff_s`, while probes fail, and a probe that succeeds brings the channel back.

The backend is healthy when no channel is failing, down when every channel it was used through
is failing and one is down, or one is down, its probe failed too and no call was served since it
went down; degraded otherwise (a read-only directory: writes down, reads serving). Every change
of that state is reported once, to `on_change` (a log line), never once per call or page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from runtime.errors import ConfigError
from runtime.storage.backend import Buffer, StorageBackend
from runtime.trace import get_logger

__all__ = ["Health", "HealthPolicy", "HealthTracked", "HealthTracker"]

_log = get_logger("hicache.storage.health")


class Health(str, Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DOWN = "down"

    @property
    def level(self) -> int:
        """0 healthy, 1 degraded, 2 down (a gauge's value)."""
        return _LEVELS[self]


_LEVELS = {Health.HEALTHY: 0, Health.DEGRADED: 1, Health.DOWN: 2}
CHANNELS = ("lookup", "read", "write")


@dataclass(frozen=True)
class HealthPolicy:
    down_after: int = 3  # consecutive failed calls that take a channel down
    backoff_s: float = 0.1  # first wait before a down channel is probed
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if type(self.down_after) is not int or self.down_after < 1:
            raise ConfigError(f"down_after must be an int >= 1, got {self.down_after!r}")
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ConfigError(f"backoff_s must be in (0, max_backoff_s], got {self.backoff_s!r} "
                              f"(max_backoff_s {self.max_backoff_s!r})")


@dataclass
class _Channel:
    used: bool = False
    failing: int = 0  # consecutive failed calls
    retry_at: float = 0.0  # when down: the monotonic time of the next probe
    backoff: float = 0.0
    probing: bool = False  # a probe is in flight (other calls are still skipped)
    down_at: int = 0  # the tracker's call count when it last went down
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("calls", "failures", "skipped"), 0))

    def begin(self, policy: HealthPolicy, clock: Callable[[], float]) -> bool:
        """A call is about to be made: False when the channel is down and no probe is due."""
        self.used = True
        if self.failing >= policy.down_after:  # down: only a probe goes through, once due
            if self.probing or clock() < self.retry_at:
                self.counts["skipped"] += 1
                return False
            self.probing = True
        self.counts["calls"] += 1
        return True

    def force_down(self, policy: HealthPolicy, clock: Callable[[], float], seq: int) -> None:
        """Down now (the backend said it is not there): probed with backoff from here."""
        self.used = True
        while self.failing < policy.down_after:
            self.settle(True, policy, clock, seq)

    def settle(self, failed: bool, policy: HealthPolicy, clock: Callable[[], float], seq: int) -> None:
        """A call made through `begin` ended (the tracker's `seq`-th); a failure that takes the
        channel down starts (or doubles) its backoff."""
        self.probing = False
        self.used = True  # (a caller may skip `begin` while every channel is healthy)
        if not failed:
            self.failing, self.backoff = 0, 0.0
            return
        self.counts["failures"] += 1
        self.failing += 1
        if self.failing == policy.down_after:
            self.down_at = seq
        if self.failing >= policy.down_after:
            self.backoff = min(policy.max_backoff_s, self.backoff * 2 if self.backoff else policy.backoff_s)
            self.retry_at = clock() + self.backoff


def log_change(old: Health, new: Health, reason: str) -> None:
    (_log.info if new is Health.HEALTHY else _log.warning)("storage_health_changed", old=old.value, new=new.value,
                                                             reason=reason)


class HealthTracker:
    """The health of one backend from the outcomes of its calls, per channel (the module
    docstring): `begin` before a call (False: the channel is down and no probe is due, do not
    make it), `settle` after it (or at its deadline: a call that never returns is a failed one).
    Thread-safe (a connector's worker calls from two threads); `on_change` runs outside the lock."""

    def __init__(self, policy: HealthPolicy | None = None, *,
                 on_change: Callable[[Health, Health, str], None] = log_change,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy or HealthPolicy()
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._channels = {name: _Channel() for name in CHANNELS}
        self.state = Health.HEALTHY  # (written under the lock; read by anyone)
        self._changes = 0
        self._since = clock()  # when the state last changed
        self._settled = self._served = 0  # calls settled; the count at the last one served
        self._gone = False  # `mark_down`: not there, whatever the channels' calls said

    def begin(self, channel: str) -> bool:
        with self._lock:
            return self._channels[channel].begin(self.policy, self._clock)

    def settle(self, channel: str, error: str | None) -> None:
        """A call `begin` let through ended: failed with `error`, or served (None)."""
        with self._lock:
            self._settled += 1
            if error is None:
                self._served = self._settled
                if self._gone:  # it was not there; it answers: all of it is back
                    self._gone = False
                    for ch in self._channels.values():
                        ch.settle(False, self.policy, self._clock, self._settled)
            self._channels[channel].settle(error is not None, self.policy, self._clock, self._settled)
            old, new = self._move(self._health())
        if old is not new:
            self._on_change(old, new, f"{channel}: {error}" if error is not None else f"{channel} served")

    def mark_down(self, reason: str) -> None:
        """The backend is not there (its own cheap check said so, `reachable()`): every channel
        down at once, probed with backoff as after failed calls."""
        with self._lock:
            self._settled += 1
            for ch in self._channels.values():
                ch.force_down(self.policy, self._clock, self._settled)
            self._gone = True  # down until a call is served (then every channel is back)
            old, new = self._move(Health.DOWN)
        if old is not new:
            self._on_change(old, new, reason)

    def _move(self, new: Health) -> tuple[Health, Health]:
        """(Under the lock.) The state becomes `new`; returns (old, new), counting a change."""
        old = self.state
        if new is not old:
            self.state, self._since = new, self._clock()
            self._changes += 1
        return old, new

    def next_probe_in(self, channel: str = "lookup") -> float | None:
        """Seconds until `channel` may be probed (0: now, as it is not down); None while its probe
        is in flight (the next is due once that one settles)."""
        with self._lock:
            ch = self._channels[channel]
            if ch.probing:
                return None
            return max(0.0, ch.retry_at - self._clock()) if ch.failing >= self.policy.down_after else 0.0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            s: dict[str, Any] = {"health": self.state.value, "health_level": self.state.level,
                                 "health_changes": self._changes,
                                 "health_seconds": round(self._clock() - self._since, 3)}
            for name, ch in self._channels.items():
                for k, v in ch.counts.items():
                    s[f"{name}_{k}"] = v
        return s

    def _health(self) -> Health:
        """Down: every channel used failing, one of them down; or a channel down whose probe failed
        too, with no call of any channel served since it went down (a channel not called since,
        e.g. no page left to write, tells nothing). Degraded: a channel failing."""
        if self._gone:
            return Health.DOWN
        used = [ch for ch in self._channels.values() if ch.used]
        limit = self.policy.down_after
        down = [ch for ch in used if ch.failing >= limit]
        if down and (all(ch.failing for ch in used)
                     or any(ch.failing > limit and ch.down_at > self._served for ch in down)):
            return Health.DOWN
        return Health.DEGRADED if any(ch.failing for ch in used) else Health.HEALTHY


class HealthTracked:
    """`inner` with its health tracked (`HealthTracker`), and the calls of a down channel held
    back (see the module docstring). Thread-safe: a connector's worker reads and writes from two
    threads."""

    def __init__(self, inner: StorageBackend, policy: HealthPolicy | None = None, *,
                 on_change: Callable[[Health, Health, str], None] = log_change,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.page_bytes = inner.page_bytes
        self.tracker = HealthTracker(policy, on_change=on_change, clock=clock)
        self.policy = self.tracker.policy
        # `read_prefix` prefers a one-pass `get_prefix`: offered when the inner backend has one
        if getattr(inner, "get_prefix", None) is None:
            self.get_prefix = None  # type: ignore[assignment]
        self.read_chunk_bytes = getattr(inner, "read_chunk_bytes", 0)  # (`read_prefix`: local calls, checked per chunk)

    @property
    def state(self) -> Health:
        return self.tracker.state

    # -- the backend's calls -----------------------------------------------------------------------
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        return self._call("lookup", lambda: self.inner.exists_prefix(keys), 0)

    def get_batch(self, keys: Sequence[bytes], dests: Sequence[Buffer],
                  tags: list[bytes | None] | None = None) -> list[bool]:
        return self._call("read", lambda: self.inner.get_batch(keys, dests, tags), [False] * len(keys))

    def get_prefix(self, keys: Sequence[bytes], dests: Sequence[Buffer], tags: list[bytes | None] | None = None) -> int:
        return self._call("read", lambda: self.inner.get_prefix(keys, dests, tags), 0)  # type: ignore[attr-defined]

    def set_batch(self, keys: Sequence[bytes], srcs: Sequence[Buffer], tags: Sequence[bytes] | None = None) -> list[bool]:
        return self._call("write", lambda: self.inner.set_batch(keys, srcs, tags), [False] * len(keys),
                          failed=lambda ok: len(ok) > 0 and not any(ok))

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), **self.tracker.stats()}

    def _call(self, channel: str, call: Callable[[], Any], skipped: Any,
              failed: Callable[[Any], bool] = lambda _: False) -> Any:
        if not self.tracker.begin(channel):
            return skipped
        try:
            result = call()
        except Exception as exc:
            self.tracker.settle(channel, repr(exc))
            raise
        self.tracker.settle(channel, f"{channel} stored no page" if failed(result) else None)
        return result
