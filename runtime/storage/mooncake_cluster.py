"""`LocalMooncakeCluster`: a Mooncake master and metadata server on 127.0.0.1 for tests, benchmarks
and one-machine deployments, and the helpers that find and start Mooncake's executables."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from runtime.storage.backend import StorageError
from runtime.storage.mooncake_config import INSTALL_HINT, MooncakeConfig

_PR_SET_PDEATHSIG = 1
# looked up here, not in the forked child (a dlopen there could wait on a lock another thread held)
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def find_binary(name: str) -> str | None:
    """A Mooncake executable: next to this Python (the venv's bin), else on PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which(name, path=here + os.pathsep + os.environ.get("PATH", ""))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int) -> None:
    """In a spawned server, before it runs: SIGKILL it when the process that started it dies, even
    by a crash that runs no `stop()` (Linux ``PR_SET_PDEATHSIG``; strictly, when the *thread* that
    started it ends: start a cluster from a thread that outlives it, e.g. the main thread)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above: nobody would stop us
        os._exit(1)


def _wait_port(host: str, port: int, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.02)
    return False


class LocalMooncakeCluster:
    """A ``mooncake_master`` and a standalone ``mooncake_http_metadata_server``, both listening on
    127.0.0.1 only (free ports), started and stopped (and reaped) by this object; both are killed
    when the process that started them dies, so even a crash that runs no `stop()` leaves none
    behind (Linux; `_die_with_parent`).

    The master's built-in metadata server is not used: it ignores its host flag. Note that
    Mooncake *clients* (`MooncakeBackend`) open their transfer listeners on all interfaces
    whatever ``MC_TCP_BIND_ADDRESS`` says; the tests therefore run in a private network
    namespace (see tests/unit/storage/conftest.py)."""

    HOST = "127.0.0.1"

    def __init__(self, *, lease_ttl_ms: int = 500, eviction_high_watermark: float = 0.9,
                 log_dir: str | None = None, start_timeout_s: float = 20.0) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="mooncake-")
        self.start_timeout_s = start_timeout_s
        self.rpc_port = self.metadata_port = self.metrics_port = 0
        self._procs: list[subprocess.Popen] = []
        self._logs: list[Any] = []

    @property
    def master_address(self) -> str:
        return f"{self.HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.HOST}:{self.metadata_port}/metadata"

    @property
    def pids(self) -> dict[str, int]:
        """The running cluster's processes: ``{"metadata": pid, "master": pid}``."""
        return {name: p.pid for name, p in zip(("metadata", "master"), self._procs)}

    @property
    def master_pid(self) -> int:
        return self.pids["master"]

    def config(self, **overrides: Any) -> MooncakeConfig:
        base = MooncakeConfig(master_server_address=self.master_address, metadata_server=self.metadata_url,
                              local_hostname=self.HOST, tcp_bind_address=self.HOST)
        return replace(base, **overrides) if overrides else base

    def _spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        self._logs.append(log)
        env = dict(os.environ)
        env.setdefault("MC_TCP_BIND_ADDRESS", self.HOST)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True, preexec_fn=functools.partial(_die_with_parent, os.getpid()))
        self._procs.append(p)
        return p

    def log_tail(self, name: str, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> "LocalMooncakeCluster":
        master = find_binary("mooncake_master")
        meta = find_binary("mooncake_http_metadata_server")
        if not master or not meta:
            raise StorageError(f"mooncake_master / mooncake_http_metadata_server not found; {INSTALL_HINT}")
        last = ""
        for _attempt in range(3):  # a free port can be taken between probe and bind
            self.stop()
            self.rpc_port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
            deadline = time.monotonic() + self.start_timeout_s
            pm = self._spawn([meta, "--host", self.HOST, "--port", str(self.metadata_port), "--log-level", "WARNING"],
                             "metadata")
            pr = self._spawn(self._master_argv(master), "master")
            if _wait_port(self.HOST, self.metadata_port, pm, deadline) and _wait_port(self.HOST, self.rpc_port, pr, deadline):
                return self
            last = f"master log: {self.log_tail('master')}\nmetadata log: {self.log_tail('metadata')}"
        self.stop()
        raise StorageError(f"local Mooncake cluster did not start\n{last}")

    def _master_argv(self, master: str) -> list[str]:
        return [master, f"--rpc_address={self.HOST}", f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=false", f"--metrics_host={self.HOST}",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.lease_ttl_ms}",
                f"--eviction_high_watermark_ratio={self.eviction_high_watermark}"]

    def kill_master(self) -> None:
        """SIGKILL the master (an outage: its clients are not told); `restart_master` brings one back."""
        os.kill(self.master_pid, signal.SIGKILL)
        self._procs[1].wait(timeout=5)

    def restart_master(self) -> None:
        """A fresh master on the same address (it knows nothing the old one held)."""
        master = find_binary("mooncake_master")
        assert master is not None and self._procs[1].poll() is not None, "the master is still running"
        self._procs[1] = self._spawn(self._master_argv(master), "master")
        if not _wait_port(self.HOST, self.rpc_port, self._procs[1], time.monotonic() + self.start_timeout_s):
            raise StorageError(f"the Mooncake master did not restart\n{self.log_tail('master')}")

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)
        self._procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()

    def __enter__(self) -> "LocalMooncakeCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
