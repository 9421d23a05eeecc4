"""`RuntimeConfig`: every knob of the runtime, validated with a clear message.

Built in code (typed values), or from a dict, the environment (`HICACHE_*`) or a JSON / TOML
file, where sizes may be written as "8GiB" and text is converted per field
(runtime/config_sources.py; docs/API.md, "Configuration").
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from runtime.config_sources import (NO_KEY, check_types, config_from_dict, config_from_env, config_from_file,
                                    no_key_text)
from runtime.errors import ConfigError
from runtime.memory.groups import FULL, RECURRENT, SLIDING, Feature, GroupSpec
from runtime.memory.state_pool import STATE_POOL_PREFIX, StateComponent, StateShape
from runtime.memory.swa import SWA_POOL

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
EVICTION_POLICIES = ("lru", "lfu", "priority")
REUSE_COSTS = ("always", "measured")  # load every hit | load a hit only where it beats recomputing
HOST_LAYOUTS = ("layer_first", "page_first")
STORAGE_BACKENDS = ("none", "file", "mooncake")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
COPY_ENGINES = ("auto", "cpu", "cuda", "fake")
# fp8 pools hold the engine's already-quantized KV: the cache moves and stores bytes, the model
# keeps any per-layer scales (docs/ARCHITECTURE.md, "KV dtypes")
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
# per-token KV parts: "mha" K and V (MHA / GQA); "mla" one latent vector (DeepSeek's MLA: the
# normalized c_kv and the rotated k_pe, written num_kv_heads=1, head_dim = their width)
KV_LAYOUTS = {"mha": 2, "mla": 1}
MIN_KEY_BYTES = 16  # a storage_key (a MAC key, runtime.storage.integrity) shorter than this is guessable
# The page hash of KV events and storage keys (docs/STORAGE.md, "Page hashes"): SHA-256 (a
# cryptographic hash: no one can make two prefixes share a page's address), or xxHash's XXH3-128
# (several times faster, not collision resistant against an adversary choosing tokens)
HASH_ALGOS = ("sha256", "xxhash")


def parse_state_components(spec: str) -> tuple[StateComponent, ...]:
    """ "conv:64x4:float32,ssm:8x16x16:float32" -> the components (ConfigError naming the field)."""
    out = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        try:
            name, dims, dtype = parts
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            raise ConfigError(f"state_components: {item.strip()!r} is not name:AxB...:dtype") from None
        if dtype not in KV_DTYPES:
            raise ConfigError(f"state_components: dtype {dtype!r} of {name!r} not one of {sorted(KV_DTYPES)}")
        out.append(StateComponent(name, shape, KV_DTYPES[dtype]))
    try:
        StateShape(1, tuple(out))
    except ConfigError as exc:
        raise ConfigError(f"state_components: {exc}") from None
    return tuple(out)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_storage_key(key: object) -> None:
    """None (unkeyed) or a MAC key of at least MIN_KEY_BYTES bytes; text that holds no key (empty,
    blank, "none", "null") is refused as from the environment. The value is never in a message."""
    if key is None:
        return
    _need(not no_key_text(key), f"storage_key {NO_KEY}")
    _need(isinstance(key, str) and len(key.encode()) >= MIN_KEY_BYTES,
          f"storage_key must be a string of at least {MIN_KEY_BYTES} bytes (a MAC key; its value is not shown)")


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    # KV identity and shape (per token: layers x (K, V) x kv_heads x head_dim; "mla": layers x one latent)
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    kv_layout: str = "mha"
    kv_dtype: str = "float32"
    model_id: str = "model"
    weight_version: str = "0"
    # the page hash of KV events and storage keys (HASH_ALGOS); part of the storage identity
    hash_algo: str = "sha256"
    # Tensor parallelism: this runtime's rank of tp_size, each rank holding its own KV heads
    # (num_kv_heads is the rank's); the shard is part of the storage identity (docs/STORAGE.md)
    tp_rank: int = 0
    tp_size: int = 1
    # One control plane over every rank of the instance (docs/ARCHITECTURE.md, "Tensor
    # parallelism"): this runtime drives `tp_ranks` ranks, each with device and host pools of its
    # own (rank 0's the identity's: tp_size must equal it, tp_rank 0); 1: this runtime is one rank
    tp_ranks: int = 1
    # Recurrent state of a hybrid model (Mamba / linear-attention layers; docs/ARCHITECTURE.md,
    # "Recurrent state"): `state_layers` recurrent layers, each holding the components of
    # `state_components` ("name:dim x dim...:dtype", comma separated, e.g.
    # "conv:64x4:float32,ssm:8x16x16:float32"), in `state_slots` device state slots shared by
    # running requests and the tree's snapshots. 0 layers: a pure attention model
    state_layers: int = 0
    state_components: str = ""
    state_slots: int = 0
    host_state_slots: int | None = None  # host copies of snapshots (None: 2 x state_slots with a host tier)
    # Sliding-window attention (docs/ARCHITECTURE.md, "Pool groups"): the layers in `sliding_layers`
    # ("0,1,3" or (0, 1, 3): indices into num_layers; "" none) read only the last `sliding_window` tokens and keep
    # their K/V in a pool of their own of `swa_tokens` slots (None: as many as device_slots), whose
    # pages the tree drops where no match can need them
    sliding_layers: str = ""
    sliding_window: int = 0
    swa_tokens: int | None = None
    # Device pool
    device: str = "cpu"
    page_size: int = 16
    device_slots: int = 4096
    # Host tier: exactly one sizing rule is used (tokens, then bytes, then ratio); 0 tokens disables it
    host_ratio: float = 2.0
    host_tokens: int | None = None
    host_bytes: int | None = None
    host_layout: str = "layer_first"
    # Tree policies
    write_policy: str = "write_through_selective"
    write_through_threshold: int = 2
    eviction_policy: str = "lru"
    # "measured": a host hit loads only where the load beats recomputing it, by measured load and
    # prefill rates (`CacheRuntime.observe_prefill`; runtime/transfer/load_cost.py)
    reuse_cost: str = "always"
    # Transfer
    copy_engine: str = "auto"
    copy_workers: int = 1
    max_inflight_loads: int = 3
    max_queued_backups: int = 64
    # Decode offload (decode node of a disaggregated setup)
    decode_offload: bool = False
    offload_stride: int | None = None
    # Storage tier (third tier; needs the host tier). "none" unless a backend is given to open()
    storage_backend: str = "none"
    storage_dir: str | None = None  # file backend directory
    storage_cap_bytes: int | None = None  # file backend size cap (whole directory)
    prefetch_policy: str = "timeout"  # SGLang's default: an admit waits for a prefetch at most prefetch_timeout()
    prefetch_threshold: int = 0  # tokens beyond the device + host hit below which no prefetch starts
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_1k_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    storage_timeout_s: float = 5.0  # deadline of one backend call; past it the op is overdue (docs/STORAGE.md)
    # backend calls in flight at once, overdue ones included (more wait; one past its deadline unstarted is skipped)
    storage_max_inflight_ops: int = 4
    # host pages that overdue reads and writes may hold (their calls may still move them) before no
    # read or write starts until some return (None: an eighth of the host pool)
    storage_max_overdue_pages: int | None = None
    # Keyed page tags (docs/STORAGE.md, "Page integrity"): with a key (>= 16 bytes; HICACHE_STORAGE_KEY),
    # a page read from storage must carry a MAC made with it, so pages written without it are refused.
    # Never shown: not in repr, logs, stats or error messages
    storage_key: str | None = dataclasses.field(default=None, repr=False)
    # KV cache events in vLLM's wire format (docs/EVENTS.md): recorded when on, for in-process
    # subscribers (`Runtime.kv_events()`), and published over ZMQ when an endpoint is given
    kv_events: bool = False
    kv_events_endpoint: str | None = None  # ZMQ PUB, e.g. "tcp://127.0.0.1:5557" ("...:*": any free port)
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER answering replay requests (None: no replay)
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    data_parallel_rank: int | None = None  # stamped on every batch (vLLM's KVEventBatch field)
    # Actors
    mailbox_capacity: int = 4096
    # Debugging and tracing
    debug_invariants: bool = False
    trace_path: str | None = None
    # Caller contract: token ids must lie in [0, vocab_size) (default: [0, 2**31), the int32 range)
    vocab_size: int | None = None
    # Prometheus metrics (docs/API.md, "Metrics"): a /metrics endpoint on metrics_addr:metrics_port
    # (None: none; 0: a free port), the exported snapshot refreshed every metrics_interval_s
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        spec = self.sliding_layers
        if isinstance(spec, (tuple, list)) and all(type(x) is int for x in spec):
            object.__setattr__(self, "sliding_layers", ",".join(map(str, spec)))  # one form: the string
        check_types(self)  # every field its type (ints, finite floats, real bools), then the ranges
        self._check_sizes()
        self._check_state(_need)
        self._check_sliding(_need)
        self._check_device()
        self._check_tiers()
        self._check_names()
        self._check_groups(_need)

    def _check_sizes(self) -> None:
        """Counts, the page size and the KV layout."""
        need = _need
        for name in ("num_layers", "num_kv_heads", "head_dim", "device_slots", "mailbox_capacity", "copy_workers",
                     "max_inflight_loads", "max_queued_backups", "write_through_threshold"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                 f"{name} must be a positive integer, got {value!r}")
        need(type(self.tp_size) is int and self.tp_size > 0, f"tp_size must be a positive integer, got {self.tp_size!r}")
        need(type(self.tp_rank) is int and 0 <= self.tp_rank < self.tp_size,
             f"tp_rank must be an int in [0, tp_size) = [0, {self.tp_size}), got {self.tp_rank!r}")
        self._check_tp_ranks(need)
        ps = self.page_size
        need(isinstance(ps, int) and 1 <= ps <= 256 and ps & (ps - 1) == 0,
             f"page_size must be a power of two in 1..256, got {ps!r}")
        need(self.device_slots % ps == 0, f"device_slots ({self.device_slots}) must be a multiple of page_size ({ps})")
        need(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        need(self.kv_layout in KV_LAYOUTS, f"kv_layout must be one of {sorted(KV_LAYOUTS)}, got {self.kv_layout!r}")
        need(self.hash_algo in HASH_ALGOS, f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if self.kv_layout == "mla":
            need(self.num_kv_heads == 1, f"kv_layout 'mla' keeps one latent per token: num_kv_heads must be 1 "
                                         f"(head_dim = kv_lora_rank + qk_rope_head_dim), got {self.num_kv_heads}")

    def _check_device(self) -> None:
        """The torch device, policies and the copy engine."""
        need = _need
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"device {self.device!r} is not a torch device: {exc}") from None
        need(dev.type in ("cpu", "cuda"), f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if dev.type == "cuda":
            need(torch.cuda.is_available(), "device 'cuda' asked for but CUDA is not available")
        need(self.host_layout in HOST_LAYOUTS, f"host_layout must be one of {HOST_LAYOUTS}, got {self.host_layout!r}")
        need(self.write_policy in WRITE_POLICIES, f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        need(self.eviction_policy in EVICTION_POLICIES,
             f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        need(self.reuse_cost in REUSE_COSTS, f"reuse_cost must be one of {REUSE_COSTS}, got {self.reuse_cost!r}")
        need(self.copy_engine in COPY_ENGINES, f"copy_engine must be one of {COPY_ENGINES}, got {self.copy_engine!r}")
        if self.copy_engine == "cuda":
            need(dev.type == "cuda", "copy_engine 'cuda' needs device 'cuda'")

    def _check_tiers(self) -> None:
        """The host and storage tiers, prefetch and its timeouts."""
        need, ps = _need, self.page_size
        need(isinstance(self.host_ratio, (int, float)) and self.host_ratio >= 0,
             f"host_ratio must be >= 0, got {self.host_ratio!r}")
        if self.host_tokens is not None:
            need(isinstance(self.host_tokens, int) and self.host_tokens >= 0 and self.host_tokens % ps == 0,
                 f"host_tokens must be a non-negative multiple of page_size ({ps}), got {self.host_tokens!r}")
        if self.host_bytes is not None:
            need(isinstance(self.host_bytes, int) and self.host_bytes >= 0, f"host_bytes must be >= 0, got {self.host_bytes!r}")
        if self.offload_stride is not None:
            need(isinstance(self.offload_stride, int) and self.offload_stride > 0 and self.offload_stride % ps == 0,
                 f"offload_stride must be a positive multiple of page_size ({ps}), got {self.offload_stride!r}")
        need(self.storage_backend in STORAGE_BACKENDS,
             f"storage_backend must be one of {STORAGE_BACKENDS}, got {self.storage_backend!r}")
        if self.storage_backend == "file":
            need(isinstance(self.storage_dir, str) and bool(self.storage_dir), "storage_backend 'file' needs storage_dir")
        if self.storage_backend != "none":
            need(self.host_slots > 0, "a storage tier needs the host tier (host_tokens/host_bytes/host_ratio > 0)")
        if self.storage_cap_bytes is not None:
            need(isinstance(self.storage_cap_bytes, int) and self.storage_cap_bytes > 0,
                 f"storage_cap_bytes must be a positive int or None, got {self.storage_cap_bytes!r}")
        need(self.prefetch_policy in PREFETCH_POLICIES,
             f"prefetch_policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}")
        need(isinstance(self.prefetch_threshold, int) and self.prefetch_threshold >= 0,
             f"prefetch_threshold must be a non-negative int, got {self.prefetch_threshold!r}")
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                 f"{name} must be a non-negative number, got {value!r}")
        need(isinstance(self.storage_timeout_s, (int, float)) and not isinstance(self.storage_timeout_s, bool)
             and 0 < self.storage_timeout_s < float("inf"),
             f"storage_timeout_s must be a positive number of seconds, got {self.storage_timeout_s!r}")
        need(type(self.storage_max_inflight_ops) is int and self.storage_max_inflight_ops > 0,
             f"storage_max_inflight_ops must be a positive int, got {self.storage_max_inflight_ops!r}")
        need(self.storage_max_overdue_pages is None
             or (type(self.storage_max_overdue_pages) is int and self.storage_max_overdue_pages >= 0),
             f"storage_max_overdue_pages must be a non-negative int or None, got {self.storage_max_overdue_pages!r}")
        _check_storage_key(self.storage_key)

    def _check_names(self) -> None:
        """Names, KV events and metrics."""
        need = _need
        need(bool(self.model_id) and bool(self.weight_version), "model_id and weight_version must be non-empty")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                need(self.kv_events, f"{name} needs kv_events=True")
                need(isinstance(value, str) and value.startswith(("tcp://", "ipc://", "inproc://")),
                     f"{name} must be a ZMQ endpoint (tcp://, ipc:// or inproc://), got {value!r}")
        need(isinstance(self.kv_events_topic, str), f"kv_events_topic must be a str, got {self.kv_events_topic!r}")
        need(type(self.kv_events_buffer_steps) is int and self.kv_events_buffer_steps > 0,
             f"kv_events_buffer_steps must be a positive int, got {self.kv_events_buffer_steps!r}")
        if self.data_parallel_rank is not None:
            need(type(self.data_parallel_rank) is int and self.data_parallel_rank >= 0,
                 f"data_parallel_rank must be a non-negative int or None, got {self.data_parallel_rank!r}")
        if self.vocab_size is not None:
            need(type(self.vocab_size) is int and 0 < self.vocab_size <= 1 << 31,
                 f"vocab_size must be an int in 1..2**31 or None, got {self.vocab_size!r}")
        if self.metrics_port is not None:
            need(type(self.metrics_port) is int and 0 <= self.metrics_port <= 65535,
                 f"metrics_port must be an int in 0..65535 (0: any free port) or None, got {self.metrics_port!r}")
        need(isinstance(self.metrics_addr, str) and bool(self.metrics_addr),
             f"metrics_addr must be a non-empty host address, got {self.metrics_addr!r}")
        need(isinstance(self.metrics_interval_s, (int, float)) and not isinstance(self.metrics_interval_s, bool)
             and 0 < self.metrics_interval_s < float("inf"),
             f"metrics_interval_s must be a positive number of seconds, got {self.metrics_interval_s!r}")

    def _check_tp_ranks(self, need) -> None:  # noqa: ANN001 - the local `need` of __post_init__
        need(type(self.tp_ranks) is int and self.tp_ranks > 0,
             f"tp_ranks must be a positive integer, got {self.tp_ranks!r}")
        if self.tp_ranks == 1:
            return
        need(self.tp_size == self.tp_ranks and self.tp_rank == 0,
             f"tp_ranks {self.tp_ranks}: one control plane drives every rank of the instance, so tp_size must "
             f"equal it and tp_rank be 0 (got tp_size {self.tp_size}, tp_rank {self.tp_rank})")

    def _check_state(self, need) -> None:  # noqa: ANN001 - the local `need` of __post_init__
        for name in ("state_layers", "state_slots"):
            value = getattr(self, name)
            need(type(value) is int and value >= 0, f"{name} must be a non-negative int, got {value!r}")
        if self.host_state_slots is not None:
            need(type(self.host_state_slots) is int and self.host_state_slots >= 0,
                 f"host_state_slots must be a non-negative int or None, got {self.host_state_slots!r}")
        need(isinstance(self.state_components, str), f"state_components must be a str, got {self.state_components!r}")
        if self.state_layers == 0:
            need(self.state_components == "" and self.state_slots == 0 and not self.host_state_slots,
                 "state_components, state_slots and host_state_slots need state_layers > 0")
            return
        self.state_shape  # parses state_components (ConfigError naming the field)
        need(self.state_slots > 0, "state_layers > 0 needs state_slots > 0 (running requests and snapshots)")
        need(self.storage_backend == "none" or self.host_state_slot_count > 0,
             "host_state_slots: a storage tier with recurrent state needs host state slots (snapshots reach "
             "storage through their host copies)")

    def _check_sliding(self, need) -> None:  # noqa: ANN001 - the local `need` of __post_init__
        layers = self.sliding_layer_set  # parses sliding_layers (ConfigError naming the field)
        if not layers:
            need(self.sliding_window == 0 and self.swa_tokens is None,
                 "sliding_window and swa_tokens need sliding_layers (e.g. \"0,1,3\")")
            return
        need(type(self.sliding_window) is int and self.sliding_window > 0,
             f"sliding_window must be a positive int (tokens) with sliding_layers, got {self.sliding_window!r}")
        if self.swa_tokens is not None:
            need(type(self.swa_tokens) is int and self.swa_tokens > 0 and self.swa_tokens % self.page_size == 0,
                 f"swa_tokens must be a positive multiple of page_size ({self.page_size}), got {self.swa_tokens!r}")
        need(len(layers) < self.num_layers,
             "sliding_layers: every layer slides; at least one full-attention layer is needed (not yet otherwise)")
        need(self.kv_layout == "mha", "sliding_layers needs kv_layout 'mha'")

    def _check_groups(self, need) -> None:  # noqa: ANN001 - the local `need` of __post_init__
        """Each pool group must support every feature asked for, beside the other groups (their
        declarations: `runtime.memory.groups`)."""
        wanted = {f for f, on in ((Feature.STORAGE, self.storage_backend != "none"),
                                  (Feature.DECODE_OFFLOAD, bool(self.decode_offload)),
                                  (Feature.TENSOR_PARALLEL, self.tp_ranks > 1)) if on}
        specs = self.group_specs
        for spec in specs:
            for why in spec.refusals(wanted, tuple(o for o in specs if o is not spec)):
                need(False, why)

    # -- derived -------------------------------------------------------------------
    @property
    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The model's pool groups: full attention, then sliding layers and recurrent state if asked for."""
        specs = [GroupSpec.of(FULL, "kv_layout", "token", (), self.bytes_per_token)]
        if self.sliding_layer_set:
            per_layer = self.bytes_per_token // self.num_layers
            specs.append(GroupSpec.of(SLIDING, "sliding_layers", "token", (SWA_POOL,),
                                      per_layer * len(self.sliding_layer_set)))
        shape = self.state_shape
        if shape is not None:
            specs.append(GroupSpec.of(RECURRENT, "recurrent state (state_layers > 0)", "snapshot",
                                      tuple(STATE_POOL_PREFIX + c.name for c in shape.components),
                                      shape.bytes_per_slot))
        return tuple(specs)

    @property
    def sliding_layer_set(self) -> tuple[int, ...]:
        """The sliding-window layers, ascending (empty: none)."""
        spec = self.sliding_layers
        if not isinstance(spec, str):
            raise ConfigError(f"sliding_layers must be a str of layer indices (\"0,1,3\"), got {spec!r}")
        if not spec.strip():
            return ()
        try:
            layers = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ConfigError(f"sliding_layers: {spec!r} is not comma-separated layer indices") from None
        if len(set(layers)) != len(layers) or not all(0 <= x < self.num_layers for x in layers):
            raise ConfigError(f"sliding_layers: {spec!r} must name distinct layers in [0, num_layers={self.num_layers})")
        return tuple(sorted(layers))

    @property
    def swa_slots(self) -> int:
        """Device slots of the sliding layers' pool (0: no sliding layers)."""
        if not self.sliding_layer_set:
            return 0
        return self.swa_tokens if self.swa_tokens is not None else self.device_slots

    @property
    def state_shape(self) -> StateShape | None:
        """The recurrent state of one slot (None: no recurrent layers)."""
        if self.state_layers == 0:
            return None
        return StateShape(self.state_layers, parse_state_components(self.state_components))

    @property
    def host_state_slot_count(self) -> int:
        """Host state slots: `host_state_slots`, else twice `state_slots` when there is a host tier."""
        if self.state_layers == 0 or self.host_slots == 0:
            return 0
        return self.host_state_slots if self.host_state_slots is not None else 2 * self.state_slots

    @property
    def torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def kv_parts(self) -> int:
        """Tensors per token per layer: 2 (K and V) or 1 (the MLA latent); `KVShape.parts`."""
        return KV_LAYOUTS[self.kv_layout]

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.kv_parts * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def host_slots(self) -> int:
        """Host pool size in slots, rounded down to whole pages."""
        if self.host_tokens is not None:
            slots = self.host_tokens
        elif self.host_bytes is not None:
            slots = self.host_bytes // self.bytes_per_token
        else:
            slots = int(self.device_slots * self.host_ratio)
        return slots - slots % self.page_size

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds `admit` waits for a prefetch under the `timeout` policy."""
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * num_tokens / 1000
        return min(t, self.prefetch_timeout_max_s)

    @property
    def stride(self) -> int:
        return self.offload_stride or self.page_size

    def replace(self, **changes: object) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)

    # -- outside sources (conversion rules: runtime/config_sources.py) ----------------
    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "RuntimeConfig":
        """Fields by name (missing ones keep their defaults); strings converted by the field's type,
        byte fields also as "8GiB"; an unknown key is a `ConfigError` suggesting the nearest field."""
        return config_from_dict(cls, data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "HICACHE_",
                 base: "RuntimeConfig | Mapping[str, object] | None" = None) -> "RuntimeConfig":
        """`base` overridden by `PREFIX<FIELD>` variables of `environ` (default `os.environ`), e.g.
        HICACHE_PAGE_SIZE=16, HICACHE_HOST_BYTES=64GiB; a prefixed variable naming no field is an error."""
        return config_from_env(cls, os.environ if environ is None else environ, prefix, base)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "RuntimeConfig":
        """A flat JSON object or TOML document of fields, by the file's suffix (.json / .toml)."""
        return config_from_file(cls, path)

    def to_dict(self) -> dict[str, object]:
        """Every field by name, typed (sizes in bytes, None kept): `from_dict(c.to_dict()) == c`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
