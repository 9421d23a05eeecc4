"""Fixtures for the storage tests: a private network namespace runner and a local Mooncake cluster.

Mooncake clients open their transfer listeners on every interface (``MC_TCP_BIND_ADDRESS``
only changes the address they advertise), so the Mooncake tests run inside a fresh network
namespace that holds nothing but loopback: `netns_run` starts a command there (as root:
``unshare(CLONE_NEWNET)``; otherwise in a new user namespace too), brings ``lo`` up and
execs it. Inside, `mooncake_cluster` starts ``mooncake_master`` and the standalone
``mooncake_http_metadata_server`` on free 127.0.0.1 ports, waits until both accept
connections, and stops them at the end.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.netns import in_private_netns, netns_argv

NETNS_ENV = "HICACHE_TEST_NETNS"


@pytest.fixture
def netns_run():
    """``run(argv, env=None, timeout=...) -> CompletedProcess`` inside a private network namespace."""

    def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120.0,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run(netns_argv(argv), env=full_env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)

    return run


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory):
    """A running local Mooncake cluster (master + metadata server on 127.0.0.1)."""
    if not in_private_netns() and os.environ.get("HICACHE_MOONCAKE_HOST_NETNS") != "1":
        pytest.fail("Mooncake tests must run in a private network namespace (the launcher test does this); "
                    "set HICACHE_MOONCAKE_HOST_NETNS=1 to run them in the host namespace on purpose")
    from runtime.storage.mooncake_cluster import LocalMooncakeCluster

    cluster = LocalMooncakeCluster(log_dir=str(tmp_path_factory.mktemp("mooncake-logs")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
