"""The API fuzzer's entry points (tests/fuzz/harness.py; docs/TESTING.md, "API fuzzer").

- `test_api_fuzz`: the default suite's run, >= 20,000 API calls from a fixed seed
  (`HICACHE_FUZZ_SEED` picks another);
- `test_api_fuzz_long`: `--runslow`, >= 10**6 calls (`HICACHE_FUZZ_CALLS` overrides);
- `test_replay`: one episode, `HICACHE_FUZZ_SEED=S HICACHE_FUZZ_EPISODE=E pytest tests/fuzz -k replay`
  (the line a failure prints), shrunk again and printed when it fails; `HICACHE_FUZZ_PEER=1`: a peer
  episode (tests/fuzz/test_peer_fuzz.py).

`HICACHE_FUZZ_HYBRID=1` runs only the episodes with recurrent state (about 1 in 5 otherwise) in
the first two, e.g. `HICACHE_FUZZ_HYBRID=1 HICACHE_FUZZ_SEED=7 pytest tests/fuzz -k "api_fuzz and not long"`.

A failure prints the violation, the replay line and the shrunk steps as Python code.
"""

from __future__ import annotations

import os

import pytest

from tests.fuzz import harness as H

CI_SEED = 1
CI_CALLS = 20_000
SLOW_CALLS = 1_000_000


def _report(report: H.FuzzReport, record_property, capsys) -> None:
    record_property("api_calls", report.calls)
    record_property("api_calls_per_s", round(report.calls_per_s))
    with capsys.disabled():  # the figures show in a plain run (docs/TESTING.md quotes them)
        print(f"\n{report.summary()}")
    if report.failure is not None:
        pytest.fail(H.reproduction(report), pytrace=False)


def test_api_fuzz(record_property, capsys):
    seed = H.env_int("HICACHE_FUZZ_SEED", CI_SEED)
    assert seed is not None
    report = H.fuzz(seed, CI_CALLS, max_seconds=600, shrink_s=60, only=H.env_only())
    _report(report, record_property, capsys)
    assert report.calls >= CI_CALLS, f"only {report.calls} calls ran in the time limit"


@pytest.mark.slow
def test_api_fuzz_long(record_property, capsys):
    seed = H.env_int("HICACHE_FUZZ_SEED", CI_SEED + 1000)
    calls = H.env_int("HICACHE_FUZZ_CALLS", SLOW_CALLS)
    assert seed is not None and calls is not None
    report = H.fuzz(seed, calls, shrink_s=300, only=H.env_only())
    _report(report, record_property, capsys)
    assert report.calls >= calls


@pytest.mark.skipif(not os.environ.get("HICACHE_FUZZ_EPISODE"), reason="set HICACHE_FUZZ_SEED and HICACHE_FUZZ_EPISODE")
def test_replay(record_property, capsys):
    seed, episode = H.env_int("HICACHE_FUZZ_SEED", CI_SEED), H.env_int("HICACHE_FUZZ_EPISODE", 0)
    assert seed is not None and episode is not None
    report = H.fuzz(seed, 1, first_episode=episode, shrink_s=120, episodes=H.env_episodes())
    _report(report, record_property, capsys)


def test_deterministic_episodes_replay_step_for_step():
    """The replay line and the shrinker rely on it: an episode on the fake engine without storage,
    replayed from its recorded steps, makes the same calls and ends the same way."""
    checked = 0
    for episode in range(40):
        cfg, rng = H.generate_episode(CI_SEED, episode)
        if not cfg.deterministic or checked == 3:
            continue
        first = H.run_episode(cfg, rng)
        again = H.run_episode(cfg, H.random.Random(0), first.steps)
        assert again.outcomes == first.outcomes
        assert (again.violation and (again.violation.kind, again.violation.step)) == \
            (first.violation and (first.violation.kind, first.violation.step))
        checked += 1
    assert checked == 3
