"""DeepSeek-V3 (multi-head latent attention, MLA) whose per-token cache is one latent vector per
layer in the runtime's device pool.

MLA caches, per token and layer, the compressed KV: ``c_kv`` (``kv_lora_rank`` wide, after
``kv_a_layernorm``) and the shared RoPE key ``k_pe`` (``qk_rope_head_dim`` wide, rotated at its
position): the latent ``[c_kv ‖ k_pe]`` of ``kv_lora_rank + qk_rope_head_dim`` elements. The
runtime's pool for it has one part (``KVShape.parts == 1``, ``num_kv_heads == 1``, ``head_dim`` =
the latent width; ``RuntimeConfig.kv_layout == "mla"``) and ``pool.latent[layer]`` is
``[num_slots, 1, latent]``.

Route: transformers' ``DeepseekV3Attention.forward`` computes the latent, updates its cache with it
and expands it to per-head K/V (``expand_kv``: ``kv_b_proj``) only afterwards, so the latent is
exactly what transformers itself caches. Each attention module's ``forward`` is replaced (on the
instance) by :func:`paged_mla_attention`, which repeats transformers' math up to the cache update
(q through ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj``; RoPE interleaved or not, as
``config.rope_interleave`` says; the softmax scale with YaRN's mscale is the module's own
``scaling``), writes the new tokens' latents into the pool at the request's slots, gathers the
latents of positions ``0 .. total-1`` by slot, expands them with the module's own ``expand_kv``
(correctness first: no weight absorption) and attends with the causal mask of absolute positions.
Projections, norms, MLP / MoE and the rotary embedding stay transformers' own. A forward not driven
by :class:`PagedMLAModel` runs the class's own ``forward``, so ``model(...)`` and ``generate`` work
unchanged on a hooked model.

:class:`PagedMLAModel` is :class:`~runtime.integrations.hf_llama.PagedKVModel` with this pool and
this attention: the same batch preparation (ragged, right-padded, absolute positions), the same
``forward(seqs, *, before_layer=None, return_all_logits=False)`` and ``num_layers``, so
:class:`~runtime.integrations.serving.ServingLoop` drives it unchanged.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, apply_rotary_pos_emb,
                                                                   apply_rotary_pos_emb_interleave)

from runtime.integrations.hf_llama import _CTX_KW, PagedKVModel, _PagedContext

__all__ = ["PagedMLAModel", "mla_geometry", "mla_shape", "paged_mla_attention", "tiny_deepseek_v3"]


def paged_mla_attention(
    module: DeepseekV3Attention,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """MLA over latents kept in a slot pool (bound to each attention module as its ``forward``)."""
    ctx: _PagedContext | None = kwargs.pop(_CTX_KW, None)
    if ctx is None:  # a plain forward / generate: transformers' own attention and cache
        return type(module).forward(module, hidden_states, position_embeddings, attention_mask,
                                    past_key_values=past_key_values, **kwargs)
    layer = module.layer_idx
    if ctx.before_layer is not None:
        ctx.before_layer(layer)
    bsz, q_len = hidden_states.shape[:-1]
    rank, rope = module.kv_lora_rank, module.qk_rope_head_dim

    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(bsz, q_len, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [module.qk_nope_head_dim, rope], dim=-1)
    kv_nope, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_nope = module.kv_a_layernorm(kv_nope).view(bsz, 1, q_len, rank)
    k_rot = k_rot.view(bsz, 1, q_len, rope)
    cos, sin = position_embeddings
    rotate = apply_rotary_pos_emb_interleave if module.config.rope_interleave else apply_rotary_pos_emb
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)

    # write the new tokens' latents [c_kv ‖ k_pe] (padded query rows write nothing)
    pool = ctx.pool.latent[layer]  # [S, 1, rank + rope]
    latent = torch.cat((kv_nope, k_rot), dim=-1).reshape(bsz * q_len, 1, rank + rope)
    if ctx.valid_rows is not None:
        latent = latent.index_select(0, ctx.valid_rows)
    pool.index_copy_(0, ctx.write_idx, latent.to(pool.dtype))
    # read positions 0..total-1 of every sequence and expand them to per-head K and V
    every = pool.index_select(0, ctx.gather_idx).view(bsz, 1, ctx.kv_len, rank + rope).to(q.dtype)
    key, value = module.expand_kv(every[..., :rank], every[..., rank:])
    out = F.scaled_dot_product_attention(torch.cat((q_pass, q_rot), dim=-1), key, value, attn_mask=ctx.mask,
                                         is_causal=ctx.is_causal, scale=module.scaling)
    out = out.transpose(1, 2).reshape(bsz, q_len, -1)
    return module.o_proj(out), None


def _hook(model: DeepseekV3ForCausalLM) -> None:
    """Bind :func:`paged_mla_attention` as every attention module's ``forward`` (idempotent; all
    modules are checked before any is changed)."""
    attns = [block.self_attn for block in model.model.layers]
    for attn in attns:
        if not isinstance(attn, DeepseekV3Attention):
            raise TypeError(f"expected DeepseekV3Attention, got {type(attn).__name__}")
    for attn in attns:
        attn.forward = types.MethodType(paged_mla_attention, attn)


def mla_geometry(config: Any) -> tuple[int, int]:
    """``(num_layers, latent width)`` of a DeepSeek-V2/V3 config: the latent is ``kv_lora_rank +
    qk_rope_head_dim`` (a runtime for it: ``kv_layout="mla"``, ``num_kv_heads=1``, ``head_dim`` = width)."""
    return int(config.num_hidden_layers), int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


def mla_shape(model: Any, dtype: torch.dtype | None = None) -> Any:
    """The runtime's one-part ``KVShape`` for ``model`` (``dtype`` defaults to the model's dtype)."""
    from runtime.memory.pools import KVShape

    layers, width = mla_geometry(model.config)
    return KVShape(layers, 1, width, dtype or model.dtype, parts=1)


class PagedMLAModel(PagedKVModel):
    """A ``DeepseekV3ForCausalLM`` whose latent cache lives in ``pool`` (``pool.latent[layer]``:
    ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``, e.g. a one-part ``DevicePool``) at
    per-request slots. ``forward`` is :class:`PagedKVModel`'s (see there)."""

    def __init__(self, model: DeepseekV3ForCausalLM, pool: Any, *, check_slots: bool = True) -> None:
        # not PagedKVModel.__init__ (it checks K/V pools of a Llama geometry): the latent pool's
        # checks, then the attributes that the inherited forward reads
        layers, width = mla_geometry(model.config)
        latents = getattr(pool, "latent", None)
        if not latents or len(latents) < layers:
            raise ValueError(f"pool has {len(latents or [])} latent layers (a one-part pool), the model {layers}")
        for layer in range(layers):
            t = latents[layer]
            if t.dim() != 3 or tuple(t.shape[1:]) != (1, width):
                raise ValueError(f"pool layer {layer}: shape {tuple(t.shape)}, expected [slots, 1, {width}]")
        device = latents[0].device
        if next(model.parameters()).device != device:
            raise ValueError(f"model on {next(model.parameters()).device}, pool on {device}")
        _hook(model)
        model.eval()
        self.model = model
        self.pool = pool
        self.check_slots = check_slots
        self.num_layers = layers
        self.vocab_size = int(model.config.vocab_size)
        self.num_slots = int(latents[0].shape[0])
        self.device = device


def tiny_deepseek_v3(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> DeepseekV3ForCausalLM:
    """A random-weight ``DeepseekV3ForCausalLM``: 3 layers (two dense, the last a MoE of 4 routed
    experts, 2 per token, and a shared one), hidden 128, 4 heads, q_lora_rank 48, kv_lora_rank 32,
    RoPE dims 16 (interleaved), nope 16, v 16 (a latent of 48), YaRN RoPE (factor 4, so the softmax
    scale carries mscale), vocab 512. Deterministic in ``seed``; the global RNG is left untouched.
    ``initializer_range`` 0.08 spreads the logits so greedy decoding has no near-ties."""
    cfg: dict[str, Any] = dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=3, first_k_dense_replace=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        rope_interleave=True, max_position_embeddings=8192, initializer_range=0.08,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=2048,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg.update(config_overrides)
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DeepseekV3ForCausalLM(config).to(dtype).eval()
