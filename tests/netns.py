"""Running a command in a private network namespace that holds only loopback (the Mooncake tests:
Mooncake clients open their transfer listeners on every interface, whatever
``MC_TCP_BIND_ADDRESS`` says). As root: ``unshare(CLONE_NEWNET)``; otherwise in a new user
namespace too. Exit status 97: neither namespace could be created (stderr says why)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

CANNOT_UNSHARE = 97

# Runs in a fresh single-threaded interpreter: enter new namespaces, bring lo up, exec argv.
BOOTSTRAP = r"""
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


def netns_argv(argv: list[str]) -> list[str]:
    """``argv`` run inside a fresh private network namespace."""
    return [sys.executable, "-c", BOOTSTRAP, *argv]


def netns_popen(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.Popen(netns_argv(argv), env=full_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run_for_result(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> tuple[dict, str]:
    """Run ``argv`` in a private network namespace (a test fails, not skips, where none can be
    made); its exit status must be 0 and it must print one line ``RESULT {json}``. Returns that
    JSON and a description of the run for assertion messages."""
    import json

    import pytest

    p = netns_popen(argv, env=env, cwd=cwd)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    if p.returncode == CANNOT_UNSHARE:
        pytest.fail(f"cannot create a private network namespace here: {err.strip()[-500:]}")
    where = f"rc {p.returncode}\n{out[-3000:]}\n{err[-4000:]}"
    assert p.returncode == 0, where
    line = next((line for line in out.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, where
    return json.loads(line[7:]), where

