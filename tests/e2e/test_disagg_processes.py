"""Two processes, prefill and decode, over Mooncake's Transfer Engine (TCP on loopback, in a
private network namespace: the engine listens on every interface): the two-process example
(`examples/disagg.py --tiny`) chats for four turns; every reply equals a one-process run's,
token for token, and each turn the prefill process sent only the pages the decode process lacked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mooncake.engine", reason="Mooncake is not installed: run scripts/install_mooncake.sh")

from tests.netns import run_for_result  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGE = 16


def test_two_processes_chat_as_one_and_send_only_the_delta():
    r, where = run_for_result([sys.executable, "examples/disagg.py", "--tiny", "--turns", "4", "--max-new-tokens", "8",
                               "--json"], env={"PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "WARNING"}, cwd=str(REPO),
                              timeout=300)
    assert r["equal"], where
    for row in r["rows"]:
        lacked = (row["prompt"] - 1) // PAGE - row["matched"] // PAGE
        assert row["sent"] == lacked * PAGE, (row, where)
    assert all(row["matched"] > 0 for row in r["rows"][1:]), where  # later turns matched on the decode side
