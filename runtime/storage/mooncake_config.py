"""`MooncakeConfig`: how to reach a Mooncake Store cluster, read from a dict, a JSON file or the
environment (the variables Mooncake and SGLang use)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from runtime.errors import ConfigError

INSTALL_HINT = "install it with scripts/install_mooncake.sh (Debian libibverbs1 libnl-3-200 libnl-route-3-200 + " \
               "pip mooncake-transfer-engine-non-cuda)"

_SIZE_SUFFIXES = (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10), ("t", 1 << 40),
                  ("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10), ("b", 1))


def parse_size(value: int | str) -> int:
    """``123``, ``"123"``, ``"512mb"``, ``"4GB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    s = str(value).strip().lower().replace(" ", "")
    for suffix, mult in _SIZE_SUFFIXES:
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass(frozen=True)
class MooncakeConfig:
    """How to reach a Mooncake Store cluster (field names follow Mooncake's own config)."""

    master_server_address: str                 # "host:port" of mooncake_master's RPC
    metadata_server: str                       # "http://host:port/metadata", "etcd://host:2379", "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"          # the address peers use to reach this client
    global_segment_size: int = 512 << 20       # memory this process contributes to the pool (0: none)
    local_buffer_size: int = 128 << 20         # this client's transfer buffer for the plain calls
    protocol: str = "tcp"                      # "tcp" or "rdma"
    device_name: str = ""                      # RDMA NICs, e.g. "mlx5_0,mlx5_1" (or "" / "auto-discovery")
    replica_num: int = 1
    key_prefix: str = "hicache/"
    tcp_bind_address: str | None = None        # exported as MC_TCP_BIND_ADDRESS before setup
    env: dict[str, str] = field(default_factory=dict)  # other MC_* variables to export before setup
    close_timeout_s: float = 5.0               # how long close() waits for calls in flight (then abandons them)

    def __post_init__(self) -> None:
        for name in ("global_segment_size", "local_buffer_size"):
            object.__setattr__(self, name, parse_size(getattr(self, name)))
            if getattr(self, name) < 0:
                raise ConfigError(f"MooncakeConfig.{name} must be >= 0")
        if not self.master_server_address or ":" not in self.master_server_address:
            raise ConfigError(f"master_server_address must be 'host:port', got {self.master_server_address!r}")
        if not self.metadata_server:
            raise ConfigError("metadata_server must be set (http://host:port/metadata, etcd://..., P2PHANDSHAKE)")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if not isinstance(self.replica_num, int) or self.replica_num < 1:
            raise ConfigError(f"replica_num must be >= 1, got {self.replica_num!r}")
        if isinstance(self.close_timeout_s, bool) or not isinstance(self.close_timeout_s, (int, float)) \
                or not 0 <= self.close_timeout_s < float("inf"):
            raise ConfigError(f"close_timeout_s must be a finite number >= 0, got {self.close_timeout_s!r}")

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "MooncakeConfig":
        known = {f.name for f in fields(MooncakeConfig)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown MooncakeConfig keys {sorted(unknown)}")
        return MooncakeConfig(**d)

    @staticmethod
    def from_file(path: str) -> "MooncakeConfig":
        with open(path, encoding="utf-8") as f:
            return MooncakeConfig.from_dict(json.load(f))

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> "MooncakeConfig":
        """``MOONCAKE_CONFIG_PATH`` (a JSON file of these fields), else the variables Mooncake and
        SGLang use: ``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_LOCAL_HOSTNAME``,
        ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``, ``MOONCAKE_PROTOCOL``,
        ``MOONCAKE_DEVICE``, ``MOONCAKE_TCP_BIND_ADDRESS``, ``MOONCAKE_KEY_PREFIX``."""
        env = os.environ if environ is None else environ
        path = env.get("MOONCAKE_CONFIG_PATH")
        if path:
            return MooncakeConfig.from_file(path)
        if not env.get("MOONCAKE_MASTER"):
            raise ConfigError("set MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER to use the Mooncake backend")
        d: dict[str, Any] = {
            "master_server_address": env["MOONCAKE_MASTER"],
            "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
        }
        for var, name in (("MOONCAKE_LOCAL_HOSTNAME", "local_hostname"),
                          ("MOONCAKE_GLOBAL_SEGMENT_SIZE", "global_segment_size"),
                          ("MOONCAKE_LOCAL_BUFFER_SIZE", "local_buffer_size"),
                          ("MOONCAKE_PROTOCOL", "protocol"), ("MOONCAKE_DEVICE", "device_name"),
                          ("MOONCAKE_TCP_BIND_ADDRESS", "tcp_bind_address"), ("MOONCAKE_KEY_PREFIX", "key_prefix")):
            if env.get(var):
                d[name] = env[var]
        return MooncakeConfig(**d)
