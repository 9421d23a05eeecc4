"""Two processes, prefill and decode, over Mooncake's Transfer Engine (TCP on loopback, in a
private network namespace: the engine listens on every interface): the two-process example
(`examples/disagg.py --tiny`) chats for four turns; every reply equals a one-process run's,
token for token, and each turn the prefill process sent only the pages the decode process lacked."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mooncake.engine", reason="Mooncake is not installed: run scripts/install_mooncake.sh")

from tests.netns import CANNOT_UNSHARE, netns_popen  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGE = 16


def test_two_processes_chat_as_one_and_send_only_the_delta():
    p = netns_popen([sys.executable, "examples/disagg.py", "--tiny", "--turns", "4", "--max-new-tokens", "8", "--json"],
                    env={"PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "WARNING"}, cwd=str(REPO))
    out, err = p.communicate(timeout=300)
    if p.returncode == CANNOT_UNSHARE:
        pytest.fail(f"cannot create a private network namespace here: {err.strip()[-500:]}")
    where = f"rc {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    assert p.returncode == 0, where
    r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert r["equal"], where
    for row in r["rows"]:
        lacked = (row["prompt"] - 1) // PAGE - row["matched"] // PAGE
        assert row["sent"] == lacked * PAGE, (row, where)
    assert all(row["matched"] > 0 for row in r["rows"][1:]), where  # later turns matched on the decode side
