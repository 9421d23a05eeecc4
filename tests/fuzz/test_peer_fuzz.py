"""The API fuzzer on a decode runtime whose storage tier is a fake prefill peer
(tests/fuzz/fake_peer.py; `harness.draw_peer_config`; docs/TESTING.md, "Peer episodes").

- `test_peer_fuzz`: the default suite's run, `PEER_CALLS` API calls of seed `PEER_SEED`'s peer
  episodes (`HICACHE_FUZZ_SEED` picks another): no violation, and the peer's faults reached the
  runtime (reads that hit, failed, went overdue, pages rejected by their tags);
- `test_peer_fuzz_long`: `--runslow`, `SLOW_PEER_CALLS` calls (`HICACHE_FUZZ_CALLS` overrides);
- `test_the_oracles_see_what_the_peer_wrote`: a peer filling another prompt's KV under good tags is
  caught (`kv-content`).

A failure prints the violation, the replay line (`HICACHE_FUZZ_PEER=1 ...`) and the shrunk steps.
"""

from __future__ import annotations

import pytest

from tests.fuzz import harness as H
from tests.fuzz.fake_peer import FakePeer

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
    """The default run."""
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
