"""The connector fuzzer (tests/fuzz/connector_harness.py) over vLLM 0.33's real scheduler.

- `test_connector_fuzz_finds_nothing`: the default run's episodes find no violation.
- `test_connector_fuzz_finds_the_planted_bug`: each planted connector variant is found within
  `PLANT_BUDGET` episodes of the same seed (the harness stops at the first violation).
  `unheld_hits` is the connector before it held reported hits:
  a hit whose host pages were evicted, or whose storage read found no host room, between its
  report and its load (under vLLM's default "fail" policy, a failed request).
  `staged_one_page_off`: a staging read puts each storage page into the next host page. The two
  bugs this fuzzer found in the connector have no plant any more, since storage hits are staged
  into the host tier before they are reported and every load reads host pages only: a load cut
  short by a short storage read (it copied its first pages in host-page order), and a request
  aborted while its load ran also backed up (vLLM heard of it twice): a backup then finds every
  page the load reads in the host tier already, and backs up nothing. The guards against the
  second stay (the scheduler side's `_awaiting`, the core's `loading`).
- `test_connector_fuzz_long`: `--runslow`, `HICACHE_CONNECTOR_FUZZ_EPISODES` episodes (2,000 by
  default) from `HICACHE_CONNECTOR_FUZZ_SEED` (1).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by scripts/install_vllm.sh")

from tests.e2e.vllm_engine import save_tiny_model  # noqa: E402
from tests.fuzz.connector_harness import PLANTS, run  # noqa: E402

CI_EPISODES = 60
# (a storage plant's search skips the episodes without storage, where it cannot show: `STORAGE_PLANTS`;
# the harness stops at a find)
PLANT_BUDGET = 1000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(str(path))
    return str(path)


def _report(capsys, out: dict) -> None:
    with capsys.disabled():
        print(f"\nconnector fuzz: {json.dumps(out)}")


def test_connector_fuzz_finds_nothing(model_dir, capsys):
    out = run(1, CI_EPISODES, model_dir)
    _report(capsys, out)
    assert not out["found"], out.get("violation")
    # the episodes reach what they are for: loads from both tiers, failures, preemption, aborts
    assert out["tokens_loaded"] > 0 and out["tokens_storage_loaded"] > 0 and out["load_errors"] > 0
    assert out["backup_errors"] > 0 and out["preemptions"] > 0 and out["aborted"] > 0
    # hits cut to the host room (a load fault fails its request only in an episode under the
    # "fail" policy: 1-2 of the 60 did before loads could land steps later, none since)
    assert out["hits_cut"] > 0
    assert out["stagings"] > 0 and out["tokens_staged"] > 0 and out["stagings_short"] > 0  # (reads short, failing)
    assert out["instances"] > CI_EPISODES  # some episodes restarted on their storage


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_connector_fuzz_finds_the_planted_bug(plant, model_dir, capsys):
    out = run(1, PLANT_BUDGET, model_dir, plant)
    _report(capsys, out)
    assert out["found"], f"{plant} not found in {PLANT_BUDGET} episodes"


@pytest.mark.slow
def test_connector_fuzz_long(model_dir, capsys):
    episodes = int(os.environ.get("HICACHE_CONNECTOR_FUZZ_EPISODES", "2000"))
    out = run(int(os.environ.get("HICACHE_CONNECTOR_FUZZ_SEED", "1")), episodes, model_dir)
    _report(capsys, out)
    assert not out["found"], out.get("violation")
