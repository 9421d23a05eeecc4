"""Gemma 3 text models (sliding-window and full-attention layers mixed) with K/V in the device pool.

The architecture: ``Gemma3ForCausalLM`` (transformers' own model code: RoPE with one base
frequency for the sliding layers and another for the full ones, q/k norms, scaled embeddings).
Its ``config.layer_types`` says per layer ``"sliding_attention"`` or ``"full_attention"``;
every sliding layer has the window ``W = config.sliding_window``. Chosen over Mistral (every
layer sliding) because a model that mixes both is the case the runtime's SWA rule must get
right: full layers need every position, sliding layers only the last ones.

Window convention (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W`` on top of
causal; its ``DynamicSlidingWindowLayer`` keeps the last ``W - 1`` tokens): a query at position
``p`` of a sliding layer attends to keys at positions ``max(0, p - W + 1) .. p``, ``W`` keys
including itself. A forward that computes positions ``start .. total-1`` of a sequence therefore
needs, in its sliding layers, the K/V of positions ``max(0, start - W + 1) .. total-1`` and
nothing before: :class:`PagedSWAModel` gathers only those slots for the sliding layers (a
:class:`~runtime.integrations.hf_llama.LayerRead` per layer, masked per query), so pool slots
of earlier positions are never read there. Full-attention layers read ``0 .. total-1`` as in
:class:`~runtime.integrations.hf_llama.PagedKVModel`, whose attention function, batching,
slot checks and ``before_layer`` hook this adapter uses unchanged.

With the runtime's sliding pool (``sliding_layers`` in the config: ``swa_config(model)``) the
sliding layers' K/V live in ``rt.swa_pool`` (their layers, in order) and the full layers' in
``rt.device_pool`` (the others, in order): the adapter, given ``swa_pool`` and ``swa_map``
(``rt.swa_map``: full slot -> sliding slot, -1 where the tree dropped it), writes and reads a
sliding layer at ``swa_pool[swa_map[slots]]``. A window that would read a dropped slot raises
``LookupError`` (the runtime's rule never lets it: docs/ARCHITECTURE.md, "Pool groups").

Not supported (rejected when the adapter is built): ``attn_logit_softcapping`` (SDPA has no
score softcapping), ``final_logit_softcapping`` (the adapter's logits are ``lm_head`` of the
last hidden state) and bidirectional attention. Gemma 3's released text configs set neither
softcapping.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from runtime.integrations.hf_llama import ATTN_NAME, TINY_CONFIG, LayerRead, PagedKVModel, kv_shape, random_model

__all__ = ["PagedSWAModel", "sliding_layers", "swa_config", "kv_shape", "tiny_gemma3", "window_start"]


def sliding_layers(model: Any) -> dict[int, int]:
    """``{layer index: window W}`` of the model's sliding-window layers (the others attend to
    every position). From ``config.layer_types`` when the config has them, else every layer when
    ``config.sliding_window`` is set (Mistral-style), else none."""
    config = model.config if hasattr(model, "config") else model
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return {layer: int(window) for layer in range(config.num_hidden_layers)} if window else {}
    sliding = {layer: t for layer, t in enumerate(types) if t == "sliding_attention"}
    if sliding and not (isinstance(window, int) and window > 0):
        raise ValueError(f"config has sliding_attention layers but sliding_window={window!r}")
    return {layer: int(window) for layer in sliding}


def swa_config(model: Any) -> dict[str, Any]:
    """The `RuntimeConfig` fields that give the model's sliding layers a pool of their own
    (``sliding_layers``, ``sliding_window``); ValueError when its sliding layers' windows differ."""
    windows = sliding_layers(model)
    if len(set(windows.values())) > 1:
        raise ValueError(f"sliding layers with different windows {sorted(set(windows.values()))}: one pool needs one")
    return dict(sliding_layers=",".join(map(str, sorted(windows))), sliding_window=next(iter(windows.values()), 0))


class _SplitPool:
    """``k[layer]`` / ``v[layer]`` by model layer over two pools: the full pool's layers for the
    full-attention layers, the sliding pool's for the sliding ones (each in layer order)."""

    def __init__(self, full: Any, swa: Any, sliding: list[int], num_layers: int) -> None:
        sources = {layer: (swa, i) for i, layer in enumerate(sliding)}
        rest = [layer for layer in range(num_layers) if layer not in sources]
        sources.update({layer: (full, i) for i, layer in enumerate(rest)})
        self.k = [sources[layer][0].k[sources[layer][1]] for layer in range(num_layers)]
        self.v = [sources[layer][0].v[sources[layer][1]] for layer in range(num_layers)]


def window_start(start: int, window: int) -> int:
    """First position a sliding layer with ``window`` reads when a forward computes positions
    from ``start`` on: the window of the query at ``start`` begins at ``start - window + 1``."""
    return max(0, start - window + 1)


class PagedSWAModel(PagedKVModel):
    """:class:`~runtime.integrations.hf_llama.PagedKVModel` for a model with sliding-window
    layers: the sliding layers read only the slots of their window (``sliding_layers``), the
    full ones every position. Same interface, so ``ServingLoop`` drives it unchanged."""

    def __init__(self, model: Any, pool: Any, *, check_slots: bool = True, swa_pool: Any = None,
                 swa_map: torch.Tensor | None = None) -> None:
        config = model.config
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ValueError(f"{name}={getattr(config, name)!r} is not supported by the paged adapter")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported by the paged adapter")
        if (swa_pool is None) != (swa_map is None):
            raise ValueError("swa_pool and swa_map go together (rt.swa_pool, rt.swa_map)")
        self.windows = sliding_layers(model)
        self.swa_map = swa_map
        full = pool
        if swa_pool is not None:
            if len(swa_pool.k) != len(self.windows):
                raise ValueError(f"swa_pool has {len(swa_pool.k)} layers, the model {len(self.windows)} sliding ones")
            pool = _SplitPool(full, swa_pool, sorted(self.windows), config.num_hidden_layers)
        super().__init__(model, pool, check_slots=check_slots)
        self.num_slots = int(full.k[0].shape[0])  # the full slots a sequence maps

    def _layer_reads(
        self, slots: list[torch.Tensor], starts: list[int], totals: list[int], position_ids: torch.Tensor
    ) -> dict[int, LayerRead] | None:
        if not self.windows:
            return None
        write_idx = None
        if self.swa_map is not None:  # the sliding pool's slots of each sequence's positions
            slots = [self._mapped(b, s, st) for b, (s, st) in enumerate(zip(slots, starts, strict=True))]
            write_idx = torch.cat([s[st:] for s, st in zip(slots, starts, strict=True)])
        by_window = {w: self._window_read(w, slots, starts, totals, position_ids, write_idx)
                     for w in set(self.windows.values())}
        return {layer: by_window[w] for layer, w in self.windows.items()}

    def _mapped(self, b: int, slots: torch.Tensor, start: int) -> torch.Tensor:
        """Sequence `b`'s sliding slots (``swa_map[slots]``, on the model's device); LookupError if
        the widest window from `start` on reads one that was dropped (checked on the host, where
        the map is: one check per sequence, not a device sync per sequence and window)."""
        assert self.swa_map is not None
        mapped = self.swa_map[slots.cpu()]
        lo = window_start(start, max(self.windows.values()))
        gone = torch.nonzero(mapped[lo:] < 0)
        if len(gone):
            raise LookupError(f"seq {b}: a sliding layer's window reads position {lo + int(gone[0])}, "
                              f"whose sliding KV was dropped")
        return mapped.to(self.device)

    def _window_read(
        self, window: int, slots: list[torch.Tensor], starts: list[int], totals: list[int], position_ids: torch.Tensor,
        write_idx: torch.Tensor | None = None,
    ) -> LayerRead:
        """Key column ``c`` of sequence ``b`` is position ``lo_b + c`` (``lo_b = window_start``);
        a query at ``p`` sees it iff ``p - W < lo_b + c <= p``. Columns past a sequence's end
        (ragged batch) read its last slot, written by this forward, so a masked column never
        reads a slot outside the window (a NaN there would still poison the softmax product)."""
        dev = self.device
        los = [window_start(st, window) for st in starts]
        lens = [tot - lo for tot, lo in zip(totals, los, strict=True)]
        kv_len = max(lens)
        gather = torch.empty((len(slots), kv_len), dtype=torch.long, device=dev)
        for b, (s, lo, n) in enumerate(zip(slots, los, lens, strict=True)):
            gather[b, :n] = s[lo:]
            if n < kv_len:
                gather[b, n:] = s[-1]
        k_pos = torch.tensor(los, dtype=torch.long, device=dev)[:, None] + torch.arange(kv_len, device=dev)[None, :]
        k_pos, q_pos = k_pos[:, None, None, :], position_ids[:, None, :, None]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return LayerRead(gather_idx=gather.reshape(-1), mask=mask, kv_len=kv_len, write_idx=write_idx)


def tiny_gemma3(
    seed: int = 0, dtype: torch.dtype = torch.float32, *, window: int = 20, **config_overrides: Any
) -> Gemma3ForCausalLM:
    """A random-weight ``Gemma3ForCausalLM`` (4 layers: sliding, sliding, full, sliding; window
    ``window`` tokens; hidden 128, 4 heads, 2 KV heads of dim 32, vocab 512), built in
    :data:`ATTN_NAME` mode. The default window of 20 is not a multiple of the tests' 16-token
    pages and conversations of a few turns exceed it. Deterministic in ``seed``; the global
    RNG is left untouched. ``initializer_range`` 0.08 spreads the logits (no greedy near-ties)."""
    cfg = TINY_CONFIG | dict(
        query_pre_attn_scalar=32,
        sliding_window=window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )
    return random_model(Gemma3ForCausalLM, Gemma3TextConfig(**(cfg | config_overrides)), seed, dtype)
