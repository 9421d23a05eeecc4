"""The API fuzzer on a decode runtime whose storage tier is a fake prefill peer
(tests/fuzz/fake_peer.py; `harness.draw_peer_config`; docs/TESTING.md, "Peer episodes").

- `test_peer_fuzz`: the default suite's run, `PEER_CALLS` API calls of seed `PEER_SEED`'s peer
  episodes (`HICACHE_FUZZ_SEED` picks another): no violation, and the peer's faults reached the
  runtime (reads that hit, failed, went overdue, pages rejected by their tags);
- `test_peer_fuzz_long`: `--runslow`, `SLOW_PEER_CALLS` calls (`HICACHE_FUZZ_CALLS` overrides);
- `test_the_oracles_see_what_the_peer_wrote`: a peer filling another prompt's KV under good tags is
  caught (`kv-content`);
- `test_fuzzer_finds_the_planted_double_release`: the same seed and budget with a planted double
  release (`planted.PEER_PLANTS`) report a violation.

A failure prints the violation, the replay line (`HICACHE_FUZZ_PEER=1 ...`) and the shrunk steps.
"""

from __future__ import annotations

import pytest

from tests.fuzz import harness as H
from tests.fuzz.fake_peer import FakePeer
from tests.fuzz.planted import PEER_PLANTS, search

PEER_SEED = 1
PEER_CALLS = 2_000  # about 8 episodes, 5-6 s on 2 cores
SLOW_PEER_CALLS = 100_000


def _report(report: H.FuzzReport, record_property, capsys) -> None:
    record_property("api_calls", report.calls)
    record_property("api_calls_per_s", round(report.calls_per_s))
    with capsys.disabled():
        print(f"\n{report.summary()}")
    if report.failure is not None:
        pytest.fail(H.reproduction(report), pytrace=False)


@pytest.fixture(scope="module")
def clean_run() -> H.FuzzReport:
    """The default run, without a plant (shared by the run's test and the plant's)."""
    seed = H.env_int("HICACHE_FUZZ_SEED", PEER_SEED)
    assert seed is not None
    return H.fuzz(seed, PEER_CALLS, max_seconds=300, shrink_s=30, episodes=H.peer_episode)


def test_peer_fuzz(clean_run, record_property, capsys):
    report = clean_run
    _report(report, record_property, capsys)
    assert report.calls >= PEER_CALLS and report.peer_episodes == report.episodes
    # the faults reached the runtime: hits, failed reads (drops, wrong sizes), reads past their
    # deadline (long delays), pages rejected by their tags
    for key in ("hit_tokens", "read_failures", "ops_overdue", "rejected_pages"):
        assert report.peer.get(key, 0) > 0, f"no {key} in {report.episodes} peer episodes: {report.peer}"


def test_the_oracles_see_what_the_peer_wrote(monkeypatch):
    """A peer that fills another prompt's KV under tags that check out (nothing but the KV can tell)
    is caught by the served-KV oracle: the scenario's hits are checked, not just counted."""
    pages = FakePeer._pages
    monkeypatch.setattr(FakePeer, "_pages", lambda self, tokens, extra_key, index, count:
                        pages(self, tokens, ("another prompt", extra_key), index, count))
    report = H.fuzz(PEER_SEED, PEER_CALLS, shrink_s=0, episodes=H.peer_episode)
    assert report.failure is not None and report.failure.violation is not None
    assert report.failure.violation.kind in ("kv-content", "tree-kv-content"), report.failure.violation


@pytest.mark.slow
def test_peer_fuzz_long(record_property, capsys):
    seed = H.env_int("HICACHE_FUZZ_SEED", PEER_SEED + 1000)
    calls = H.env_int("HICACHE_FUZZ_CALLS", SLOW_PEER_CALLS)
    assert seed is not None and calls is not None
    report = H.fuzz(seed, calls, shrink_s=300, episodes=H.peer_episode)
    _report(report, record_property, capsys)
    assert report.calls >= calls


def test_fuzzer_finds_the_planted_double_release(clean_run, capsys):
    """`overdue_read_released` (tests/fuzz/planted.py): a storage read past its deadline gives its
    host pages back at once, and its ack gives them back again. Installed in this process for the
    search only (`planted.search`), on the seed and budget of `test_peer_fuzz`, which runs the
    same episodes without it and finds nothing (`clean_run`). Checked failing against the broken
    variant: seed 1 reports `runtime-failed` in peer episode 0 after 7 API calls (the tree actor's
    invariant check after the overdue message: "host page 10 should be owned by prefetch:r6#12,
    ledger says None"), shrunk to 4 admits; with both invariant checks off (the actor's and the
    harness's), `tree-kv-content` in the same episode after 49 calls (host copies that do not hold
    their prefix's KV). The default run of the other episodes (`fuzz(1, 20_000)` with the plant)
    does not find it: no backend there is slower than its `storage_timeout_s`."""
    out = search(H, "overdue_read_released", clean_run.seed, PEER_CALLS, shrink_s=2)
    with capsys.disabled():
        print(f"\nplanted overdue_read_released: {({k: v for k, v in out.items() if k != 'detail'})}")
    assert clean_run.failure is None
    assert out["found"], f"not found in {out['calls']} API calls ({out['passed_over']})"
    assert out["kind"] in PEER_PLANTS["overdue_read_released"].kinds
    assert out["calls_to_find"] <= PEER_CALLS + 400  # (the episode that crossed the budget may finish)
    assert out["episode"] < clean_run.episodes  # an episode the clean run ran
    assert 1 <= out["shrunk_steps"] <= out["steps_in_episode"]
