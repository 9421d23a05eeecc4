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
import socket
import subprocess
import sys

import pytest

NETNS_ENV = "HICACHE_TEST_NETNS"

# Runs in a fresh single-threaded interpreter: enter new namespaces, bring lo up, exec argv.
_BOOTSTRAP = r"""
import ctypes, fcntl, os, socket, struct, sys
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(CLONE_NEWNET) != 0:
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        sys.stderr.write("netns: unshare(CLONE_NEWNET) and unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: %s\n"
                         % os.strerror(err))
        sys.exit(97)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write("%d %d 1" % (uid, uid))
    with open("/proc/self/gid_map", "w") as f:
        f.write("%d %d 1" % (gid, gid))
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b"")))[1]
fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
s.close()
os.execv(sys.argv[1], sys.argv[1:])
"""


def in_private_netns() -> bool:
    """True when this process's network namespace holds only loopback."""
    try:
        return [name for _i, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


@pytest.fixture
def netns_run():
    """``run(argv, env=None, timeout=...) -> CompletedProcess`` inside a private network namespace."""

    def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120.0,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run([sys.executable, "-c", _BOOTSTRAP, *argv], env=full_env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture(scope="module")
def mooncake_cluster(tmp_path_factory):
    """A running local Mooncake cluster (master + metadata server on 127.0.0.1)."""
    if not in_private_netns() and os.environ.get("HICACHE_MOONCAKE_HOST_NETNS") != "1":
        pytest.fail("Mooncake tests must run in a private network namespace (the launcher test does this); "
                    "set HICACHE_MOONCAKE_HOST_NETNS=1 to run them in the host namespace on purpose")
    from runtime.storage.mooncake_backend import LocalMooncakeCluster

    cluster = LocalMooncakeCluster(log_dir=str(tmp_path_factory.mktemp("mooncake-logs")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
