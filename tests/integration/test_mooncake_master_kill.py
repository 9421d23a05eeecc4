"""The Mooncake master killed under load (two request streams, both prefetch policies), each run a
child process in a private network namespace (`tests.integration.mooncake_master_kill`), so that
a crash is seen as a failure: no crash, no server left running, every copy and storage op settled (done,
failed or abandoned, and counted), the runtime's close bounded by `storage_timeout_s` and the
backend's by its `close_timeout_s`, and no wrong KV served.

Before the backends closed through `CallGate`, the same program (kill at 1.5 s, 3 s of load)
exited with SIGSEGV in one of two `wait_complete` runs and left its metadata server running;
the runs that lived had 2 storage ops still in flight after `close()` and a backend close of
9.7-12.8 s (`MooncakeBackend.close` tore the client down under a call waiting on the dead
master, holding the interpreter lock for the client's RPC retries). Checked failing with that
close planted back (the gate tearing down at once, no deferral): the `timeout` run died with
SIGSEGV (rc -11).

The default run has one run per policy (both at once: each spends most of its ~20 s waiting, at
exit, for Mooncake's teardown of a client whose master is gone); ``--runslow`` ten per policy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store", reason="Mooncake is not installed: run scripts/install_mooncake.sh")

from runtime.storage.mooncake_cluster import find_binary  # noqa: E402
from tests.netns import CANNOT_UNSHARE, netns_popen  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("timeout", "wait_complete")
STORAGE_TIMEOUT_S = 1.0
CLOSE_TIMEOUT_S = 2.0
SLACK_S = 1.0  # scheduling on a loaded 2-core machine


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run_scenarios(runs: list[tuple[str, int]], tmp_path: Path) -> None:
    assert find_binary("mooncake_master") and find_binary("mooncake_http_metadata_server"), \
        "Mooncake binaries missing next to the venv's python: run scripts/install_mooncake.sh"
    procs = []
    for policy, seed in runs:
        argv = [sys.executable, "-m", "tests.integration.mooncake_master_kill", "--policy", policy,
                "--seed", str(seed), "--kill-at", "1.5", "--duration", "2.5",
                "--storage-timeout", str(STORAGE_TIMEOUT_S), "--close-timeout", str(CLOSE_TIMEOUT_S),
                "--log-dir", str(tmp_path / f"{policy}-{seed}")]
        (tmp_path / f"{policy}-{seed}").mkdir()
        procs.append((policy, seed, netns_popen(argv, env={"PYTHONPATH": str(REPO)}, cwd=str(REPO))))
    for policy, seed, p in procs:
        out, err = p.communicate(timeout=180)
        where = f"{policy} seed {seed}: rc {p.returncode}\n{out[-3000:]}\n{err[-4000:]}"
        if p.returncode == CANNOT_UNSHARE:
            pytest.fail(f"cannot create a private network namespace here: {err.strip()[-500:]}")
        assert p.returncode == 0, where  # a crash (SIGSEGV: -11) fails here
        pids = json.loads(next(line for line in out.splitlines() if line.startswith("PIDS "))[5:])
        assert set(pids) == {"master", "metadata"}, where
        assert all(_gone(pid) for pid in pids.values()), f"left running: {pids}\n{where}"
        r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        assert r["wrong_positions"] == 0 and r["cached_tokens"] > 0, where
        assert r["killed_at_requests"] > 0 and r["requests"] > r["killed_at_requests"], where  # load on both sides
        assert r["ops_submitted"] == r["ops_done"] + r["ops_failed"] + r["ops_abandoned"], where
        assert r["inflight_after_close"] == 0, where
        assert r["copies_issued"] == r["copies_settled"] > 0 and r["copies_inflight"] == 0, where
        assert r["runtime_close_s"] <= STORAGE_TIMEOUT_S + SLACK_S, where
        assert r["backend_close_s"] <= CLOSE_TIMEOUT_S + SLACK_S, where


def test_master_killed_under_load(tmp_path):
    """One run per policy, both at once."""
    run_scenarios([(policy, 0) for policy in POLICIES], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 11))
def test_master_killed_under_load_ten_runs(tmp_path, seed):
    """Ten runs per policy (a policy pair per seed, at once)."""
    run_scenarios([(policy, seed) for policy in POLICIES], tmp_path)
