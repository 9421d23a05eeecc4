"""The vLLM connector's configuration: `kv_connector_extra_config` and vLLM's own config, read
and checked once, into one frozen `ConnectorConfig`.

Options (docs/VLLM.md has the table):

- ``host_bytes`` (a byte count or a size such as ``"64GiB"``, ``"1.5GB"``; units as `RuntimeConfig`
  reads them) or ``host_blocks`` (vLLM blocks), not both: the host tier of *each worker*. Default:
  the GPU pool's size, but at most a quarter of the machine's available memory shared by the
  engine's workers. Whatever is asked, every worker's host tier together must fit in 90% of the
  memory available at start.
- ``storage_backend``: ``"file"`` (the default when ``storage_dir`` is given) or ``"mooncake"``.
- ``storage_dir`` (file backend): an absolute directory path; a relative one is refused (it would
  land in whatever directory the server was started from). Created if missing.
- ``storage_cap_bytes`` (file backend): the directory's size cap, a byte count or a size.
- ``mooncake`` (Mooncake backend): a mapping of `MooncakeConfig` fields (sizes as above); without
  it, the Mooncake environment variables (`MooncakeConfig.from_env`).
- ``model_id``, ``weight_version``: what a stored page's identity names. Default: for a model
  directory, a digest of its ``config.json`` and of its weight files (names, sizes and sampled
  bytes), so two copies of one checkpoint share pages wherever they were loaded from; for a hub
  name, the name and revision vLLM resolves.

Every bad option is a `ConfigError` naming its key, raised before anything is created.
"""

from __future__ import annotations

import difflib
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import RuntimeConfig
from runtime.config_sources import parse_size
from runtime.errors import ConfigError
from runtime.memory.host_memory import MAX_HOST_SHARE, available_memory, gib
from runtime.storage.file_backend import TRAILER, FileBackend, directory_problem
from runtime.storage.hashing import KVIdentity, tp_shard
from runtime.storage.mooncake_config import MooncakeConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from runtime.storage.backend import StorageBackend

__all__ = ["ConnectorConfig", "available_memory", "open_storage", "storage_key", "KEYS"]

EXTRA = "kv_connector_extra_config"
KEYS = ("host_bytes", "host_blocks", "storage_backend", "storage_dir", "storage_cap_bytes", "mooncake",
        "model_id", "weight_version")
BACKENDS = ("file", "mooncake")
DEFAULT_HOST_SHARE = 0.25  # of available memory, for all workers' host tiers, when no size is given
_MOONCAKE_SIZES = ("global_segment_size", "local_buffer_size")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLES, _SAMPLE_BYTES = 8, 64 << 10  # per weight file, for the default model_id


@dataclass(frozen=True)
class ConnectorConfig:
    """What the connector runs with, checked. `block_bytes`: one vLLM block of every layer (of
    this worker's heads), the unit of the host pool and of a storage page."""

    host_blocks: int
    block_bytes: int
    identity: KVIdentity
    storage_backend: str | None  # None: no storage tier
    storage_dir: str | None = None
    storage_cap_bytes: int | None = None
    mooncake: MooncakeConfig | None = None

    @property
    def host_bytes(self) -> int:
        return self.host_blocks * self.block_bytes

    @property
    def storage_where(self) -> str:
        """Where pages are stored, for the start line."""
        if self.storage_backend == "file":
            return f"file:{self.storage_dir}"
        if self.mooncake is not None:
            return f"mooncake:{self.mooncake.master_server_address}/{self.mooncake.key_prefix}"
        return "none"

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  extra: Mapping[str, Any] | None = None, *, available: int | None = None) -> "ConnectorConfig":
        """Read `extra` (default: the config's ``kv_connector_extra_config``) against vLLM's config;
        `available`: bytes of memory available (default: the machine's, now)."""
        if extra is None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"{EXTRA} must be a mapping, got {type(extra).__name__}")
        for key in extra:
            if key not in KEYS:
                raise ConfigError(f"{EXTRA}: unknown option {key!r}{_suggest(str(key), KEYS)}; options: {', '.join(KEYS)}")
        group = kv_cache_config.kv_cache_groups[0]
        block_bytes = len(group.layer_names) * group.kv_cache_spec.page_size_bytes
        parallel = vllm_config.parallel_config
        workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size  # host tiers on this machine
        available = available_memory() if available is None else available
        host_blocks = _host_blocks(extra, block_bytes, kv_cache_config.num_blocks, workers, available)
        backend, storage_dir, cap, mooncake = _storage(extra, block_bytes)
        if backend is not None and parallel.pipeline_parallel_size > 1:
            # under tensor parallelism each rank stores its own heads under its own keys; pipeline
            # stages hold different layers of one page, and there are no per-stage keys yet
            raise ConfigError(f"{EXTRA}.storage_backend: HiCacheConnector's storage tier supports "
                              f"pipeline_parallel_size 1 for now")
        return cls(host_blocks, block_bytes, _identity(vllm_config, kv_cache_config, extra), backend,
                   storage_dir, cap, mooncake)


def open_storage(config: ConnectorConfig, contribute: bool = True) -> StorageBackend | None:
    """The storage tier's backend (None without one). `contribute`: whether this process lends
    memory to a Mooncake pool (workers do; the scheduler only asks what exists)."""
    if config.storage_backend == "file":
        assert config.storage_dir is not None
        try:
            return FileBackend(config.storage_dir, config.block_bytes, cap_bytes=config.storage_cap_bytes)
        except OSError as exc:  # (checked in from_vllm; the file system may have changed since)
            raise ConfigError(f"{EXTRA}.storage_dir {config.storage_dir!r}: cannot open it: {exc}") from exc
    if config.storage_backend == "mooncake":
        from runtime.storage.mooncake_backend import MooncakeBackend

        assert config.mooncake is not None
        mc = config.mooncake
        if not contribute:
            from dataclasses import replace

            mc = replace(mc, global_segment_size=0)
        return MooncakeBackend(config.block_bytes, mc)
    return None


STORAGE_KEY_ENV = "HICACHE_STORAGE_KEY"


def storage_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The workers' page-tag key: `HICACHE_STORAGE_KEY` of `environ` (default `os.environ`; None:
    unset, unkeyed tags), checked as `RuntimeConfig.from_env` checks it: a value that holds no key
    (empty, blank, none, null) or is shorter than 16 bytes is a `ConfigError` naming the variable,
    never showing the value."""
    environ = os.environ if environ is None else environ
    if STORAGE_KEY_ENV not in environ:
        return None
    try:
        return RuntimeConfig.from_env({STORAGE_KEY_ENV: environ[STORAGE_KEY_ENV]}).storage_key
    except ConfigError as exc:
        raise ConfigError(str(exc) if STORAGE_KEY_ENV in str(exc) else f"{STORAGE_KEY_ENV}: {exc}") from None


# -- the options -------------------------------------------------------------------------------
def _suggest(name: str, candidates: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _size(value: object, key: str) -> int:
    return parse_size(value, f"{EXTRA}.{key}")


def _int(value: object, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise ConfigError(f"{EXTRA}.{key} must be an integer, got {value!r}")


def _host_blocks(extra: Mapping[str, Any], block_bytes: int, gpu_blocks: int, workers: int, available: int) -> int:
    if "host_bytes" in extra and "host_blocks" in extra:
        raise ConfigError(f"{EXTRA}: give host_bytes or host_blocks, not both")
    if "host_blocks" in extra:
        key, blocks = "host_blocks", _int(extra["host_blocks"], "host_blocks")
        if blocks <= 0:
            raise ConfigError(f"{EXTRA}.host_blocks must be positive, got {blocks}")
    elif "host_bytes" in extra:
        key, nbytes = "host_bytes", _size(extra["host_bytes"], "host_bytes")
        blocks = nbytes // block_bytes
        if blocks <= 0:
            raise ConfigError(f"{EXTRA}.host_bytes ({nbytes} bytes) holds no vLLM block of {block_bytes} bytes")
    else:  # the GPU pool's size, within a share of memory that cannot exhaust it
        return max(1, min(gpu_blocks, int(available * DEFAULT_HOST_SHARE) // workers // block_bytes))
    most = int(available * MAX_HOST_SHARE)
    if blocks * block_bytes * workers > most:
        raise ConfigError(f"{EXTRA}.{key}: {blocks} blocks x {block_bytes} bytes = {gib(blocks * block_bytes)} "
                          f"per worker x {workers} worker(s) exceeds {MAX_HOST_SHARE:.0%} of the memory available "
                          f"({gib(available)})")
    return blocks


def _storage(extra: Mapping[str, Any], block_bytes: int) -> tuple[str | None, str | None, int | None, MooncakeConfig | None]:
    backend = extra.get("storage_backend", "file" if "storage_dir" in extra else None)
    if backend is None:
        for key in ("storage_cap_bytes", "mooncake"):
            if key in extra:
                raise ConfigError(f"{EXTRA}.{key} needs a storage tier (storage_dir or storage_backend)")
        return None, None, None, None
    if backend not in BACKENDS:
        raise ConfigError(f"{EXTRA}.storage_backend must be one of {BACKENDS}, got {backend!r}"
                          f"{_suggest(str(backend), BACKENDS)}")
    if backend == "mooncake":
        for key in ("storage_dir", "storage_cap_bytes"):
            if key in extra:
                raise ConfigError(f"{EXTRA}.{key} is a file backend option; storage_backend is 'mooncake'")
        return backend, None, None, _mooncake(extra.get("mooncake"))
    if "mooncake" in extra:
        raise ConfigError(f"{EXTRA}.mooncake is a Mooncake option; storage_backend is 'file'")
    if "storage_dir" not in extra:
        raise ConfigError(f"{EXTRA}.storage_dir is required with storage_backend 'file'")
    cap = None
    if extra.get("storage_cap_bytes") is not None:
        cap = _size(extra["storage_cap_bytes"], "storage_cap_bytes")
        if cap < block_bytes + TRAILER.size:
            raise ConfigError(f"{EXTRA}.storage_cap_bytes must hold at least one page file "
                              f"({block_bytes + TRAILER.size} bytes), got {cap}")
    return backend, _storage_dir(extra["storage_dir"]), cap, None


def _storage_dir(path: object) -> str:
    """An absolute directory path that is, or can be created as, a directory (nothing created here)."""
    key = f"{EXTRA}.storage_dir"
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{key} must be a directory path, got {path!r}")
    p = Path(path)
    if not p.is_absolute():
        raise ConfigError(f"{key} must be an absolute path, got {path!r} (a relative one would land in the "
                          f"server's working directory)")
    why = directory_problem(path)  # (a writable directory, or one that can be created)
    if why is not None:
        raise ConfigError(f"{key} {path!r} {why}")
    return path


def _mooncake(options: object) -> MooncakeConfig:
    key = f"{EXTRA}.mooncake"
    if options is None:
        try:
            return MooncakeConfig.from_env()
        except ConfigError as exc:
            raise ConfigError(f"{key}: not given, and from the environment: {exc}") from None
    if not isinstance(options, Mapping):
        raise ConfigError(f"{key} must be a mapping of Mooncake options, got {options!r}")
    names = [f.name for f in fields(MooncakeConfig)]
    values = dict(options)
    for name in values:
        if name not in names:
            raise ConfigError(f"{key}: unknown option {name!r}{_suggest(str(name), names)}; options: {', '.join(names)}")
    for name in _MOONCAKE_SIZES:
        if name in values:
            values[name] = _size(values[name], f"mooncake.{name}")
    if "replica_num" in values:
        values["replica_num"] = _int(values["replica_num"], "mooncake.replica_num")
    for name in ("master_server_address", "metadata_server"):
        if name not in values:
            raise ConfigError(f"{key}.{name} is required")
    try:
        return MooncakeConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    except TypeError as exc:
        raise ConfigError(f"{key}: {exc}") from None


# -- identity ----------------------------------------------------------------------------------
def _identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: Mapping[str, Any]) -> KVIdentity:
    """What makes a stored page reusable by another instance: the model and its weights, the KV
    dtype and shape (a rank's heads), the page layout (a vLLM 0.33 block: heads x block x K|V,
    every layer) and, under tensor parallelism, rank 0's shard (the scheduler's storage tier
    derives every rank's from it)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model = vllm_config.model_config
    for key in ("model_id", "weight_version"):
        if key in extra and (not isinstance(extra[key], str) or not extra[key]):
            raise ConfigError(f"{EXTRA}.{key} must be a non-empty string, got {extra[key]!r}")
    if "model_id" in extra:
        model_id = extra["model_id"]
    elif os.path.isdir(model.model):
        model_id = model_digest(model.model)
    else:
        model_id = model.model
    layout = f"vllm-block:{spec.num_kv_heads}x{spec.block_size}x{2 * spec.head_size}"
    return KVIdentity(model_id, extra.get("weight_version", model.revision or ""),
                      str(spec.dtype).removeprefix("torch."), len(group.layer_names), spec.num_kv_heads,
                      spec.head_size, layout, shard=tp_shard(0, vllm_config.parallel_config.tensor_parallel_size))


def model_digest(directory: str) -> str:
    """``sha256:<hex>`` of a model directory's content, not its path: ``config.json`` and, per
    weight file (by name), its size and `_SAMPLES` chunks spread over it (whole checkpoints are
    not hashed: tens of GB at every start). Two copies of one checkpoint get the same digest;
    checkpoints that differ in any sampled chunk, size or config differ."""
    root = Path(directory)
    h = hashlib.sha256(b"hicache-model-digest-v1\0")
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(0, size - _SAMPLE_BYTES) * i // max(1, _SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return f"sha256:{h.hexdigest()[:32]}"
