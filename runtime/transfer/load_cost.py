"""Reuse that never costs more than it saves: how much of a cache hit to load, how much to recompute.

A hit found on host or in storage is worth loading only where the load finishes before the model
could have recomputed those tokens. On a fast GPU a short prefix prefills in less time than a
host -> device load takes to start, and a slow storage tier can lose against recomputing at any
length. SGLang's tree skips host hits shorter than a fixed token count; this module decides per
request from measured rates instead.

`ReuseCost.loadable(device, host, storage)` answers, for a match with that many tokens per tier
(device first, then host, then storage: a prefix, so a storage part loads only after the whole
host part), how many host and storage tokens to load; the rest of the hit is recomputed.

`MeasuredReuseCost`'s model, per candidate (``x_h`` host and ``x_s`` storage tokens loaded, the
other ``r`` hit tokens recomputed):

- a storage read (``x_s > 0``) lands on host before any layer moves to the device: nothing
  overlaps it;
- the host -> device copy of ``x_h + x_s`` tokens moves layer by layer: the model waits for the
  whole first layer (the fixed cost plus one layer's share of the bytes) and nothing overlaps
  that, while the later layers overlap the forward's compute of the ``r`` recomputed tokens;
- so ``cost = storage + first_layer + max(rest_of_copy, prefill(r))``, against ``prefill(host +
  storage)`` for recomputing the whole hit (the miss, prefilled in both cases, is left out: it
  would only hide more of a load).

Candidates, a tier's part whole or not at all: nothing, the host part, the host and storage parts
(never part of a tier's hit: a recompute that only hides a copy would spend compute the batch's
other requests could use for microseconds of one request's latency). Rates: a least-squares line ``seconds = fixed + tokens / rate`` over the last ``window`` observations per kind
(host load, storage load, prefill), the priors until ``min_samples`` have been seen.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from runtime.errors import ValidationError
from runtime.memory.owners import Tier

__all__ = ["check_sample", "ReuseCost", "AlwaysLoad", "MeasuredReuseCost", "CostPriors", "LinearEstimate"]


class ReuseCost(Protocol):
    # whether it weighs anything: False for the null object, so callers skip asking and telling it
    weighs: bool

    def loadable(self, device_tokens: int, host_tokens: int, storage_tokens: int) -> tuple[int, int]:
        """Of a match with these tokens per tier (device first, then host, then storage), how
        many host and storage tokens to load; the rest of the hit is recomputed. Never more
        than given; whole pages (callers pass page-aligned counts, the answer is aligned)."""
        ...

    def observe_load(self, tokens: int, seconds: float, tier: Tier) -> None: ...

    def observe_prefill(self, tokens: int, seconds: float) -> None: ...

    def stats(self) -> dict[str, int]:
        """Samples seen per kind: host_load_samples, storage_load_samples, prefill_samples."""
        ...


def _check_counts(page_size: int, **counts: int) -> None:
    for name, n in counts.items():
        if type(n) is not int or n < 0:
            raise ValidationError(f"{name} must be an int >= 0, got {n!r}")
        if n % page_size:
            raise ValidationError(f"{name} must be a whole number of pages of {page_size}, got {n}")


def check_sample(tokens: int, seconds: float) -> None:
    if type(tokens) is not int or tokens <= 0:
        raise ValidationError(f"tokens must be an int > 0, got {tokens!r}")
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValidationError(f"seconds must be a finite number >= 0, got {seconds!r}")


class AlwaysLoad:
    """The null object: every hit loads (what the runtime did before the cost model)."""

    weighs = False

    def __init__(self, page_size: int = 1) -> None:
        if type(page_size) is not int or page_size < 1:
            raise ValidationError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size

    def loadable(self, device_tokens: int, host_tokens: int, storage_tokens: int) -> tuple[int, int]:
        _check_counts(self.page_size, device_tokens=device_tokens, host_tokens=host_tokens,
                      storage_tokens=storage_tokens)
        return host_tokens, storage_tokens

    def observe_load(self, tokens: int, seconds: float, tier: Tier) -> None:
        check_sample(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        check_sample(tokens, seconds)

    def stats(self) -> dict[str, int]:
        return dict.fromkeys(("host_load_samples", "storage_load_samples", "prefill_samples"), 0)


@dataclass(frozen=True)
class CostPriors:
    """What the model assumes until it has measured: rates in tokens per second, fixed costs in
    seconds (a copy's issue and first completion; a storage request's round trip)."""

    host_tokens_per_s: float = 400_000.0  # ~50 GB/s at Llama-3-8B's 128 KiB per token
    host_fixed_s: float = 200e-6
    storage_tokens_per_s: float = 40_000.0  # ~5 GB/s at 128 KiB per token
    storage_fixed_s: float = 2e-3
    prefill_tokens_per_s: float = 20_000.0

    def __post_init__(self) -> None:
        for name in ("host_tokens_per_s", "storage_tokens_per_s", "prefill_tokens_per_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValidationError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("host_fixed_s", "storage_fixed_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValidationError(f"{name} must be a finite number >= 0, got {v!r}")


class LinearEstimate:
    """``seconds ~ fixed + tokens * per_token`` over the last ``window`` samples (least squares,
    both terms kept >= 0); the prior until ``min_samples`` samples were seen."""

    __slots__ = ("_samples", "_min", "_prior", "_fit")

    def __init__(self, prior_fixed_s: float, prior_tokens_per_s: float, *, window: int, min_samples: int) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._min = min_samples
        self._prior = (float(prior_fixed_s), 1.0 / float(prior_tokens_per_s))
        self._fit: tuple[float, float] | None = None  # cached until the next sample

    def add(self, tokens: int, seconds: float) -> None:
        self._samples.append((tokens, float(seconds)))
        self._fit = None

    @property
    def samples(self) -> int:
        return len(self._samples)

    def params(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token)."""
        if len(self._samples) < self._min:
            return self._prior
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def seconds(self, tokens: int) -> float:
        fixed, per = self.params()
        return fixed + tokens * per

    def _solve(self) -> tuple[float, float]:
        n = len(self._samples)
        mx = sum(t for t, _ in self._samples) / n
        my = sum(s for _, s in self._samples) / n
        sxx = sum((t - mx) ** 2 for t, _ in self._samples)
        if sxx <= 0:  # one size only: no slope to separate from the fixed part; all of it per token
            return 0.0, my / mx
        per = sum((t - mx) * (s - my) for t, s in self._samples) / sxx
        if per <= 0:  # noise: the fixed part alone cannot say what more tokens cost; the mean rate can
            return 0.0, my / mx
        fixed = my - per * mx
        if fixed < 0:  # the line through the origin that fits best
            return 0.0, sum(t * s for t, s in self._samples) / sum(t * t for t, _ in self._samples)
        return fixed, per


class MeasuredReuseCost:
    """Loads a tier's hit only where loading it is faster than recomputing it (module docstring)."""

    weighs = True

    def __init__(self, page_size: int, num_layers: int, priors: CostPriors = CostPriors(), *,
                 window: int = 64, min_samples: int = 4) -> None:
        for name, v in (("page_size", page_size), ("num_layers", num_layers), ("window", window),
                        ("min_samples", min_samples)):
            if type(v) is not int or v < 1:
                raise ValidationError(f"{name} must be an int >= 1, got {v!r}")
        if min_samples > window:
            raise ValidationError(f"min_samples ({min_samples}) must be <= window ({window})")
        if not isinstance(priors, CostPriors):
            raise ValidationError(f"priors must be CostPriors, got {type(priors).__name__}")
        self.page_size = page_size
        self.num_layers = num_layers
        kw = dict(window=window, min_samples=min_samples)
        self._load = {
            Tier.HOST: LinearEstimate(priors.host_fixed_s, priors.host_tokens_per_s, **kw),
            Tier.STORAGE: LinearEstimate(priors.storage_fixed_s, priors.storage_tokens_per_s, **kw),
        }
        self._prefill = LinearEstimate(0.0, priors.prefill_tokens_per_s, **kw)

    # -- observations ---------------------------------------------------------------------
    def observe_load(self, tokens: int, seconds: float, tier: Tier) -> None:
        """A load of ``tokens`` from ``tier`` took ``seconds``: host, the host -> device copy
        (issue to last layer ready); storage, the read into host."""
        check_sample(tokens, seconds)
        est = self._load.get(tier) if isinstance(tier, Tier) else None
        if est is None:
            raise ValidationError(f"tier must be Tier.HOST or Tier.STORAGE, got {tier!r}")
        est.add(tokens, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed ``tokens`` prompt tokens in ``seconds``."""
        check_sample(tokens, seconds)
        self._prefill.add(tokens, seconds)

    def stats(self) -> dict[str, int]:
        return {"host_load_samples": self._load[Tier.HOST].samples,
                "storage_load_samples": self._load[Tier.STORAGE].samples, "prefill_samples": self._prefill.samples}

    # -- the decision ---------------------------------------------------------------------
    def loadable(self, device_tokens: int, host_tokens: int, storage_tokens: int) -> tuple[int, int]:
        _check_counts(self.page_size, device_tokens=device_tokens, host_tokens=host_tokens,
                      storage_tokens=storage_tokens)
        h, s = host_tokens, storage_tokens
        if h + s == 0:
            return 0, 0
        best, best_cost = (0, 0), self._prefill_s(h + s)
        for cand in ((h, 0), (h, s)):
            if cand == (0, 0):
                continue
            cost = self._cost(*cand, h, s)
            if cost < best_cost:  # strictly faster: a tie recomputes (no copy, no host pages held)
                best, best_cost = cand, cost
        return best

    def _cost(self, load_host: int, load_storage: int, host_tokens: int, storage_tokens: int) -> float:
        """Modelled seconds until the hit's KV is on device when ``load_host`` of its
        ``host_tokens`` and ``load_storage`` of its ``storage_tokens`` are loaded, the rest
        recomputed (``load_storage`` > 0 only with the whole host part)."""
        recompute = host_tokens - load_host + storage_tokens - load_storage
        moved = load_host + load_storage
        if moved == 0:
            return self._prefill_s(recompute)
        storage = self._load[Tier.STORAGE].seconds(load_storage) if load_storage else 0.0
        fixed, per = self._load[Tier.HOST].params()
        body = moved * per
        first = fixed + body / self.num_layers
        return storage + first + max(body - body / self.num_layers, self._prefill_s(recompute))

    def _prefill_s(self, tokens: int) -> float:
        # the marginal cost of more prompt tokens: the forward's own fixed cost is paid either way
        return tokens * self._prefill.params()[1] if tokens else 0.0
