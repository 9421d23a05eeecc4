"""A hybrid Mamba2 / attention model (transformers' Bamba) over the runtime's pools.

The model keeps two kinds of cache, each in the runtime's pool of its kind:

- its attention layers' K/V in the paged device pool (`runtime.memory.pools.DevicePool`,
  ``k[a]`` / ``v[a]`` ``[S, H, D]``, indexed by the attention layers' own order ``0..A-1``),
  through the paged attention of :mod:`runtime.integrations.hf_llama` (same function, same
  per-forward context: :class:`PagedHybridModel` drives a :class:`PagedKVModel` whose pool is
  the device pool seen by model layer index);
- its Mamba2 layers' recurrent state (a conv window ``[conv_dim, d_conv]`` and an SSM state
  ``[heads, head_dim, d_state]`` per layer) in a `runtime.memory.state_pool.StatePool`, one
  *state slot* per request (and one per tree-node snapshot).

Why Bamba: it is a Mamba2 model whose torch path (no mamba_ssm / causal_conv1d kernels)
continues a multi-token chunk from a given conv + SSM state: the conv sees the cached window
before the chunk and the chunked scan takes ``initial_states``, so a prefill split at any
point gives the logits of one full forward (1e-6 in fp32). Recurrent layers therefore run
whole chunks, not token by token.

Recurrent state route: each Mamba2 mixer of the model gets an instance-level ``forward`` (the
model's own weights and code; ``state_dict`` keys unchanged) that, while a
:class:`PagedHybridModel` forward runs, hands the mixer a duck-typed transformers cache
(:class:`_SlotStates`) holding the rows of the batch's state slots: the mixer reads it and
writes its new conv window and SSM state into it, and the adapter scatters them back to the
pool. Outside such a forward the mixer runs unchanged, so ``model(...)`` and
``model.generate(...)`` still work. Ragged batches are not padded into the recurrence (right
padding would run pad tokens through the state): sequences with the same chunk boundaries run
as one batch (every one-token decode together), the others one by one.

Snapshots: ``HybridSeq.snapshots`` asks for the state after position ``p-1`` in slot ``s``;
the recurrent layers split the sequence's chunk at each such ``p`` (attention and MLP layers
are per token and run the whole chunk) and copy the state there.

Per-layer readiness: ``before_layer(i)`` is called with the *model* layer index ``i``
(``0..num_hidden_layers-1``) once per layer per forward, in order, before that layer reads its
K/V (an attention layer, pool layer ``attention_layers.index(i)``) or its state (a recurrent
layer, state-pool layer ``recurrent_layers.index(i)``).
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import BambaConfig, BambaForCausalLM

from runtime.config import KV_DTYPES
from runtime.errors import ArgumentError, ConfigError, LengthError
from runtime.integrations.hf_llama import PagedKVModel, PagedOutput, PagedSeq, build_tiny, kv_geometry
from runtime.memory.pools import KVShape
from runtime.memory.state_pool import StateComponent, StatePool, StateShape

__all__ = [
    "CONV",
    "SSM",
    "HybridSeq",
    "PagedHybridModel",
    "hybrid_layers",
    "state_shape",
    "attention_kv_shape",
    "runtime_fields",
    "tiny_bamba",
]

CONV = "conv"
"""State component of a Mamba2 layer's conv window: ``[conv_dim, d_conv]`` (the conv's last inputs)."""
SSM = "ssm"
"""State component of a Mamba2 layer's SSM state: ``[heads, head_dim, d_state]``."""

_ATTENTION = "full_attention"
_RECURRENT = "linear_attention"
_CTX_KW = "hicache_paged_ctx"  # hf_llama's per-forward attention context kwarg; mixers drop it


# --------------------------------------------------------------------------------------------
# geometry


def hybrid_layers(config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(attention layers, recurrent layers)``: model layer indices of each kind, in order."""
    kinds = list(config.layers_block_type)
    unknown = sorted(set(kinds) - {_ATTENTION, _RECURRENT})
    if unknown:
        raise ConfigError(f"layers_block_type: unknown layer kinds {unknown}")
    attention = tuple(i for i, k in enumerate(kinds) if k == _ATTENTION)
    recurrent = tuple(i for i, k in enumerate(kinds) if k == _RECURRENT)
    if not attention or not recurrent:
        raise ConfigError(f"layers_block_type: a hybrid model needs both kinds, got {kinds}")
    return attention, recurrent


def state_shape(model: Any, *, ssm_dtype: torch.dtype = torch.float32) -> StateShape:
    """The recurrent state of ``model``: its Mamba2 layers, each with ``conv`` (the model's dtype)
    and ``ssm`` (``ssm_dtype``: float32 by default, as transformers' chunked scan produces it)."""
    cfg = model.config
    _, recurrent = hybrid_layers(cfg)
    d_inner = int(cfg.mamba_expand * cfg.hidden_size)
    conv_dim = d_inner + 2 * int(cfg.mamba_n_groups) * int(cfg.mamba_d_state)
    return StateShape(len(recurrent), (
        StateComponent(CONV, (conv_dim, int(cfg.mamba_d_conv)), model.dtype),
        StateComponent(SSM, (int(cfg.mamba_n_heads), int(cfg.mamba_d_head), int(cfg.mamba_d_state)), ssm_dtype),
    ))


def runtime_fields(model: Any, *, ssm_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The `RuntimeConfig` fields of ``model``'s cache: the attention layers' KV geometry and the
    recurrent state (``RuntimeConfig(**runtime_fields(model), state_slots=..., ...)``)."""
    kv = attention_kv_shape(model)
    state = state_shape(model, ssm_dtype=ssm_dtype)
    dtype_name = {v: k for k, v in KV_DTYPES.items()}
    return dict(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim,
                kv_dtype=dtype_name[kv.dtype], state_layers=state.num_layers,
                state_components=",".join(f"{c.name}:{'x'.join(map(str, c.shape))}:{dtype_name[c.dtype]}"
                                          for c in state.components))


def attention_kv_shape(model: Any, dtype: torch.dtype | None = None) -> KVShape:
    """The device pool's ``KVShape``: the attention layers only (``dtype`` defaults to the model's)."""
    attention, _ = hybrid_layers(model.config)
    _, kv_heads, head_dim = kv_geometry(model.config)
    return KVShape(len(attention), kv_heads, head_dim, dtype or model.dtype)


def tiny_bamba(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> BambaForCausalLM:
    """A random-weight ``BambaForCausalLM``: 4 layers (Mamba2, attention, Mamba2, attention),
    hidden 64, 4 heads / 2 KV heads of dim 16, Mamba2 with 4 heads of dim 32, state 16, conv 4,
    chunk 16, vocab 512; in hf_llama's paged-attention mode. Deterministic in ``seed``; the global RNG is
    left as it was."""
    arch = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_chunk_size=16,  # small: a 40-token prefill crosses chunk boundaries of the scan
    )
    return build_tiny(BambaForCausalLM, BambaConfig, seed, dtype, arch, config_overrides)


# --------------------------------------------------------------------------------------------
# requests


@dataclass(frozen=True)
class HybridSeq:
    """One sequence of a :meth:`PagedHybridModel.forward` batch.

    ``slots``: device KV slots of positions ``0 .. total-1``; ``start``: positions already
    computed (their K/V in the pool); ``input_ids``: tokens of positions ``start .. total-1``.
    ``state_slot``: the request's state slot. With ``start == 0`` the state starts from zeros;
    with ``start > 0`` it is the state after position ``start-1``: the one in ``state_slot``
    (left by the request's previous forward) or, with ``state_from``, the one in that slot (a
    tree node's snapshot; the result lands in ``state_slot``, ``state_from`` is only read).
    ``snapshots``: ``(p, s)`` pairs, ``start < p <= total``, increasing ``p``: the state after
    position ``p-1`` is written to slot ``s``.
    """

    slots: torch.Tensor | Sequence[int]
    start: int
    input_ids: torch.Tensor | Sequence[int]
    state_slot: int
    state_from: int | None = None
    snapshots: tuple[tuple[int, int], ...] = ()


def _index(x: Any) -> int | None:
    """``x`` as an int if it is an integer (Python, numpy or a 0-d integer tensor), else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and (x.dim() or x.dtype == torch.bool)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _int_vector(x: Any, what: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ArgumentError(f"{what}: expected integers, got a {x.dtype} tensor")
        return x.reshape(-1).to(device=device, dtype=torch.long)
    items = [_index(v) for v in x]
    if None in items:
        raise ArgumentError(f"{what}: expected integers")
    return torch.tensor(items, dtype=torch.long, device=device)


@dataclass(frozen=True)
class _Rows:
    """Sequences whose recurrent layers run as one batch: same chunk cut points (``cuts``,
    offsets into the new tokens, the last one = their count)."""

    seqs: torch.Tensor  # [R] batch indices
    cuts: tuple[int, ...]
    sources: torch.Tensor  # [R] state slot read (state_from or state_slot; any valid slot if fresh)
    fresh: torch.Tensor | None  # [R] bool: starts from zeros (None: none does)
    targets: torch.Tensor  # [R] state_slot
    snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]]  # cut -> (row indices, slots)


# --------------------------------------------------------------------------------------------
# recurrent state through the pool


class _SlotStates:
    """The part of a transformers cache a Bamba mixer uses, over one batch's state rows of one
    layer: it reads ``conv`` / ``ssm`` and hands its new ones back (in place for one-token steps,
    through the ``update_*`` calls for chunks)."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv = conv  # [R, conv_dim, d_conv], the model's dtype
        self.ssm = ssm  # [R, heads, head_dim, d_state], float32

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.ssm

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        # the conv of a chunk sees the cached window before it; keep the last d_conv inputs
        full = torch.cat([self.conv, conv_states.to(self.conv.dtype)], dim=-1)
        self.conv = full[..., -self.conv.shape[-1]:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        self.ssm = recurrent_states
        return recurrent_states


class _StateRun:
    """The recurrent part of one forward: which rows run together, where their state comes
    from and goes to. Installed on the model's hook for the duration of the forward."""

    def __init__(self, pool: StatePool, groups: list[_Rows], recurrent: tuple[int, ...],
                 before_layer: Callable[[int], None] | None) -> None:
        self.pool = pool
        self.groups = groups
        self.recurrent = recurrent
        self.before_layer = before_layer

    def run_mixer(self, mixer: torch.nn.Module, rec: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer(self.recurrent[rec])
        conv_pool = self.pool.layer(CONV, rec)
        ssm_pool = self.pool.layer(SSM, rec)
        out = torch.zeros_like(hidden)  # padded rows: zeros (their output is dropped)
        mixer_forward = type(mixer).forward
        for g in self.groups:
            conv = conv_pool.index_select(0, g.sources).to(hidden.dtype)
            ssm = ssm_pool.index_select(0, g.sources).to(torch.float32)
            if g.fresh is not None:
                conv[g.fresh] = 0
                ssm[g.fresh] = 0
            states = _SlotStates(conv, ssm)
            begin = 0
            for cut in g.cuts:
                out[g.seqs, begin:cut] = mixer_forward(
                    mixer, hidden[g.seqs, begin:cut], cache_params=states, attention_mask=None, **kwargs
                )
                snap = g.snapshots.get(cut)
                if snap is not None:
                    rows, slots = snap
                    conv_pool.index_copy_(0, slots, states.conv.index_select(0, rows).to(conv_pool.dtype))
                    ssm_pool.index_copy_(0, slots, states.ssm.index_select(0, rows).to(ssm_pool.dtype))
                begin = cut
            conv_pool.index_copy_(0, g.targets, states.conv.to(conv_pool.dtype))
            ssm_pool.index_copy_(0, g.targets, states.ssm.to(ssm_pool.dtype))
        return out


class _StateHook:
    """One per model (so a deep copy gets its own): the run of the forward in progress, if any."""

    def __init__(self) -> None:
        self.run: _StateRun | None = None


def _pooled_mixer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache_params: Any = None,
                          attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """A Bamba mixer's ``forward`` (bound per instance): the pool's state while a
    :class:`PagedHybridModel` forward runs, the class's own forward otherwise."""
    run = self._hicache_hook.run
    if run is None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
    kwargs.pop(_CTX_KW, None)
    return run.run_mixer(self, self._hicache_rec, hidden_states, kwargs)


def _install_hook(model: Any, recurrent: tuple[int, ...]) -> _StateHook:
    hook = getattr(model, "_hicache_state_hook", None)
    if hook is None:
        hook = _StateHook()
        for rec, layer in enumerate(recurrent):
            mixer = model.model.layers[layer].mamba
            mixer._hicache_hook = hook
            mixer._hicache_rec = rec
            # MethodType: a deep copy of the model rebinds it to the copy's mixer
            mixer.forward = types.MethodType(_pooled_mixer_forward, mixer)
        model._hicache_state_hook = hook
    return hook


class _ModelLayerKV:
    """The device pool as hf_llama's paged attention indexes it: by model layer. Recurrent
    layers (which never attend) get a zero-stride stand-in that raises if anything writes it."""

    def __init__(self, kv_pool: Any, attention: tuple[int, ...], num_layers: int) -> None:
        first = kv_pool.k[0]
        stand_in = first.new_zeros((1, *first.shape[1:])).expand(first.shape)
        self.k = [stand_in] * num_layers
        self.v = [stand_in] * num_layers
        for a, layer in enumerate(attention):
            self.k[layer] = kv_pool.k[a]
            self.v[layer] = kv_pool.v[a]


# --------------------------------------------------------------------------------------------
# the adapter


class PagedHybridModel:
    """A ``BambaForCausalLM`` whose attention K/V lives in ``kv_pool`` and whose Mamba2 state
    lives in ``state_pool``, at per-request slots.

    ``forward(seqs)`` runs one ragged batch of :class:`HybridSeq` (prefills, extends from a
    cached prefix or a snapshot, one-token decodes) and returns hf_llama's :class:`PagedOutput`.
    Every sequence is validated before anything is written (`runtime.errors` validation errors);
    ``check_slots`` also checks token ids and KV slot ranges and that no KV slot is written twice
    (host syncs on CUDA; the state slots are always checked, on the host). One forward at a time
    per model: the state route is per model, not per call.
    """

    def __init__(self, model: BambaForCausalLM, kv_pool: Any, state_pool: StatePool, *, check_slots: bool = True) -> None:
        self.attention_layers, self.recurrent_layers = hybrid_layers(model.config)
        want_kv = attention_kv_shape(model)
        if len(kv_pool.k) != want_kv.num_layers or len(kv_pool.v) != want_kv.num_layers:
            raise ConfigError(f"kv_pool has {len(kv_pool.k)} layers, the model {want_kv.num_layers} attention layers")
        want_state = state_shape(model)
        got = state_pool.shape
        if got.num_layers != want_state.num_layers or [(c.name, c.shape) for c in got.components] != [
            (c.name, c.shape) for c in want_state.components
        ]:
            raise ConfigError(f"state_pool shape {got} does not fit the model's {want_state}")
        num_layers = int(model.config.num_hidden_layers)
        try:
            self._kv = PagedKVModel(model, _ModelLayerKV(kv_pool, self.attention_layers, num_layers), check_slots=False)
        except ValueError as exc:  # layer shapes or device
            raise ConfigError(f"kv_pool: {exc}") from exc
        if state_pool.device != self._kv.device:
            raise ConfigError(f"state_pool on {state_pool.device}, the model on {self._kv.device}")
        self.model = model
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.check_slots = check_slots
        self.num_slots = self._kv.num_slots
        self.vocab_size = self._kv.vocab_size
        self.num_layers = num_layers  # model layers: what `before_layer` counts
        self._hook = _install_hook(model, self.recurrent_layers)

    def forward(
        self,
        seqs: Sequence[HybridSeq],
        *,
        before_layer: Callable[[int], None] | None = None,
        return_all_logits: bool = False,
    ) -> PagedOutput:
        run, paged = self._plan(seqs, before_layer)
        if self._hook.run is not None:
            raise RuntimeError("another PagedHybridModel forward of this model is in progress")
        self._hook.run = run
        try:
            return self._kv.forward(paged, before_layer=before_layer, return_all_logits=return_all_logits)
        finally:
            self._hook.run = None

    __call__ = forward

    # ---- helpers ----------------------------------------------------------------------------

    def _state_slot(self, x: Any, what: str) -> int:
        slot = _index(x)
        if slot is None or not 0 <= slot < self.state_pool.num_slots:
            raise ArgumentError(f"{what}: expected a state slot in [0, {self.state_pool.num_slots}), got {x!r}")
        return slot

    def _plan(self, seqs: Sequence[HybridSeq], before_layer: Callable[[int], None] | None) -> tuple[_StateRun, list[PagedSeq]]:
        """Validate the batch and group its recurrent rows; changes nothing."""
        if not seqs:
            raise LengthError("empty batch")
        dev = self._kv.device
        paged: list[PagedSeq] = []
        written: dict[int, str] = {}  # state slot -> who writes it in this forward
        reads: list[tuple[int, int]] = []
        by_cuts: dict[tuple[int, ...], list[tuple[int, int, bool, int, dict[int, int]]]] = {}
        for i, s in enumerate(seqs):
            if not isinstance(s, HybridSeq):
                raise ArgumentError(f"seq {i}: expected a HybridSeq, got {type(s).__name__}")
            slots = _int_vector(s.slots, f"seq {i} slots", dev)
            ids = _int_vector(s.input_ids, f"seq {i} input_ids", dev)
            start = _index(s.start)
            if start is None:
                raise ArgumentError(f"seq {i}: start must be an int, got {s.start!r}")
            new, total = int(ids.numel()), int(slots.numel())
            if new < 1:
                raise LengthError(f"seq {i}: no new tokens")
            if start < 0 or start + new != total:
                raise LengthError(f"seq {i}: start {start} + {new} new tokens != {total} slots")
            state_slot = self._state_slot(s.state_slot, f"seq {i} state_slot")
            source = state_slot
            if s.state_from is not None:
                if start == 0:
                    raise ArgumentError(f"seq {i}: state_from needs start > 0 (a prefill starts from zeros)")
                source = self._state_slot(s.state_from, f"seq {i} state_from")
            if not isinstance(s.snapshots, tuple):
                raise ArgumentError(f"seq {i}: snapshots must be a tuple of (position, slot) pairs")
            snaps: dict[int, int] = {}
            last = start
            for pair in s.snapshots:
                p = _index(pair[0]) if isinstance(pair, tuple) and len(pair) == 2 else None
                if p is None:
                    raise ArgumentError(f"seq {i}: snapshot {pair!r} is not a (position, slot) pair")
                if not last < p <= total:
                    raise LengthError(f"seq {i}: snapshot positions must increase within ({start}, {total}], got {p}")
                snaps[p - start] = self._state_slot(pair[1], f"seq {i} snapshot at {p}")
                last = p
            for slot, what in ((state_slot, "state_slot"), *((v, f"snapshot at {k + start}") for k, v in snaps.items())):
                if slot in written:
                    raise ArgumentError(f"seq {i}: {what} {slot} is also written by {written[slot]} in this forward")
                written[slot] = f"seq {i} {what}"
            if source != state_slot:
                reads.append((i, source))
            cuts = tuple(sorted({*snaps, new}))
            by_cuts.setdefault(cuts, []).append((i, source, start == 0, state_slot, snaps))
            paged.append(PagedSeq(slots, start, ids))
        for i, source in reads:  # a snapshot read while another row writes it would depend on order
            if source in written:
                raise ArgumentError(f"seq {i}: state_from {source} is written by {written[source]} in this forward")
        if self.check_slots:
            self._check_device_values(paged)
        groups = [self._rows(cuts, members, dev) for cuts, members in by_cuts.items()]
        return _StateRun(self.state_pool, groups, self.recurrent_layers, before_layer), paged

    def _check_device_values(self, paged: list[PagedSeq]) -> None:
        """Token ids and KV slots in range, no KV slot written twice (host syncs on CUDA)."""
        ids = torch.cat([p.input_ids for p in paged])  # type: ignore[misc]
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ArgumentError(f"token id out of range [0, {self.vocab_size})")
        every = torch.cat([p.slots for p in paged])  # type: ignore[misc]
        lo, hi = int(every.min()), int(every.max())
        if lo < 0 or hi >= self.num_slots:
            raise ArgumentError(f"KV slot out of range [0, {self.num_slots}): {lo}..{hi}")
        writes = torch.cat([p.slots[p.start:] for p in paged])  # type: ignore[index]
        if torch.unique(writes).numel() != writes.numel():
            raise ArgumentError("a KV slot is written twice in one forward")

    @staticmethod
    def _rows(cuts: tuple[int, ...], members: list[tuple[int, int, bool, int, dict[int, int]]], dev: torch.device) -> _Rows:
        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        fresh = [m[2] for m in members]
        snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for cut in cuts:
            hits = [(r, m[4][cut]) for r, m in enumerate(members) if cut in m[4]]
            if hits:
                snapshots[cut] = (t([r for r, _ in hits]), t([s for _, s in hits]))
        return _Rows(
            seqs=t([m[0] for m in members]),
            cuts=cuts,
            sources=t([m[1] for m in members]),
            fresh=torch.tensor(fresh, device=dev) if any(fresh) else None,
            targets=t([m[3] for m in members]),
            snapshots=snapshots,
        )
