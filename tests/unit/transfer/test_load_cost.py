"""The reuse cost model: which part of a host / storage hit loads, from synthetic rates."""

from __future__ import annotations

import pytest

from runtime.errors import ValidationError
from runtime.memory.owners import Tier
from runtime.transfer.load_cost import AlwaysLoad, CostPriors, LinearEstimate, MeasuredReuseCost, ReuseCost

PAGE = 16
LAYERS = 32


def model(**priors: float) -> MeasuredReuseCost:
    return MeasuredReuseCost(PAGE, LAYERS, CostPriors(**priors))


# an H200-like GPU: 55 GB/s at 128 KiB per token (~420k tokens/s), a 0.3 ms fixed cost per load,
# prefill of an 8B model ~ 40k tokens/s; a tiny model prefills ~ 5M tokens/s
FAST_LINK = dict(host_tokens_per_s=420_000.0, host_fixed_s=300e-6)


def test_the_protocol_is_met():
    for cost in (AlwaysLoad(PAGE), model()):
        assert isinstance(cost.loadable(0, 0, 0), tuple)
        _: ReuseCost = cost


def test_always_load_loads_everything_given():
    assert AlwaysLoad(PAGE).loadable(32, 160, 64) == (160, 64)


def test_a_short_prefix_on_a_fast_gpu_is_recomputed():
    cost = model(**FAST_LINK, prefill_tokens_per_s=5_000_000.0)
    # 128 tokens: 26 µs to prefill, 0.3 ms before a load's first layer is ready
    assert cost.loadable(0, 128, 0) == (0, 0)
    assert cost.loadable(256, 128, 0) == (0, 0)  # the device part changes nothing


def test_a_long_prefix_is_loaded():
    cost = model(**FAST_LINK, prefill_tokens_per_s=40_000.0)
    assert cost.loadable(0, 8192, 0) == (8192, 0)
    # a tiny model prefills faster than the link moves its KV at any length: it recomputes
    tiny = model(**FAST_LINK, prefill_tokens_per_s=5_000_000.0)
    assert tiny.loadable(0, 65536, 0) == (0, 0)


def test_slow_storage_recomputes_the_storage_part_only():
    cost = model(**FAST_LINK, prefill_tokens_per_s=40_000.0, storage_tokens_per_s=2_000.0, storage_fixed_s=5e-3)
    assert cost.loadable(0, 4096, 4096) == (4096, 0)
    # fast storage: both load
    fast = model(**FAST_LINK, prefill_tokens_per_s=40_000.0, storage_tokens_per_s=200_000.0, storage_fixed_s=1e-3)
    assert fast.loadable(0, 4096, 4096) == (4096, 4096)


def test_a_tier_loads_whole_or_not_at_all():
    # link and prefill at about the same rate: a copy of part of it could hide behind the
    # prefill of the rest, still a tier's hit loads whole or is recomputed whole
    cost = model(host_tokens_per_s=100_000.0, host_fixed_s=0.0, prefill_tokens_per_s=110_000.0)
    assert cost.loadable(0, 4096, 0) in ((0, 0), (4096, 0))
    assert cost.loadable(0, 4096, 0) == (0, 0)
    assert model(host_tokens_per_s=100_000.0, host_fixed_s=0.0, prefill_tokens_per_s=50_000.0).loadable(
        0, 4096, 0) == (4096, 0)


def test_answers_are_whole_pages_and_never_more_than_given():
    cost = model(host_tokens_per_s=90_000.0, host_fixed_s=1e-4, prefill_tokens_per_s=70_000.0,
                 storage_tokens_per_s=50_000.0)
    for h in range(0, 2048, 48):
        for s in (0, 16, 512):
            lh, ls = cost.loadable(0, h, s)
            assert 0 <= lh <= h and 0 <= ls <= s and lh % PAGE == 0 and ls % PAGE == 0
            assert ls == 0 or lh == h  # a storage part loads only after the whole host part


def test_measured_rates_replace_the_priors():
    # the priors say load; the link measures 20x slower than the prior: recompute
    cost = MeasuredReuseCost(PAGE, LAYERS, CostPriors(**FAST_LINK, prefill_tokens_per_s=200_000.0), min_samples=4)
    assert cost.loadable(0, 1024, 0) == (1024, 0)
    for n in (512, 1024, 2048):
        cost.observe_load(n, 1e-3 + n / 20_000.0, Tier.HOST)
    assert cost.loadable(0, 1024, 0) == (1024, 0)  # 3 samples: still the priors
    cost.observe_load(4096, 1e-3 + 4096 / 20_000.0, Tier.HOST)
    assert cost.loadable(0, 1024, 0) == (0, 0)
    # a slow prefill measured makes loading worth it again
    for n in (256, 512, 1024, 2048):
        cost.observe_prefill(n, n / 1_000.0)
    assert cost.loadable(0, 1024, 0) == (1024, 0)


def test_the_estimate_is_bounded_and_moves():
    est = LinearEstimate(0.0, 1.0, window=4, min_samples=2)
    for _ in range(4):
        est.add(100, 1.0)
    assert est.params() == pytest.approx((0.0, 0.01))
    for n in (100, 200, 300, 400):  # the window forgets the old samples
        est.add(n, 0.5 + n * 0.001)
    assert est.samples == 4
    assert est.params() == pytest.approx((0.5, 0.001))


@pytest.mark.parametrize("args", [(-16, 0, 0), (0, 8, 0), (0, 0, 17), (0, 1.5, 0), (0, True, 0)])
def test_bad_counts_are_refused(args):
    for cost in (AlwaysLoad(PAGE), model()):
        with pytest.raises(ValidationError):
            cost.loadable(*args)


def test_bad_observations_are_refused_and_change_nothing():
    cost = model(**FAST_LINK, prefill_tokens_per_s=5_000_000.0)
    for bad in ((0, 1.0, Tier.HOST), (16, float("nan"), Tier.HOST), (16, -1.0, Tier.HOST), (16, 1.0, Tier.DEVICE),
                (16, 1.0, "host")):
        with pytest.raises(ValidationError):
            cost.observe_load(*bad)
    with pytest.raises(ValidationError):
        cost.observe_prefill(16, float("inf"))
    assert cost.loadable(0, 128, 0) == (0, 0)
    with pytest.raises(ValidationError):
        MeasuredReuseCost(PAGE, 0)
    with pytest.raises(ValidationError):
        CostPriors(host_tokens_per_s=0.0)
