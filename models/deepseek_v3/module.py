"""DeepSeek V3 in Flax linen, numerically like transformers' DeepseekV3ForCausalLM.

Rules from huggingface/transformers:src/transformers/models/deepseek_v3/modeling_deepseek_v3.py
(5.23):
- RMSNorm as Llama's (`models.llama.module.RMSNorm`); the decoder's norms use `rms_norm_eps`,
  the two latent norms `q_a_layernorm` / `kv_a_layernorm` transformers' default eps 1e-6
  (`DeepseekV3RMSNorm(rank)`: the config's eps is not passed).
- MLA (`DeepseekV3Attention`): q = q_proj(x), or q_b(q_a_norm(q_a(x))) with `q_lora_rank`;
  per head `[qk_nope | qk_rope]`. kv_a(x) = `[kv_lora_rank latent | qk_rope shared k_rot]`;
  kv_b(kv_a_norm(latent)) per head `[k_nope (qk_nope) | v (v_head_dim)]`; k_rot is one head,
  broadcast to all. RoPE on q_rot and k_rot only, of width qk_rope_head_dim (`models.rope`
  tables, yarn's attention factor on cos/sin); with `rope_interleave` (DeepSeek's checkpoints)
  the pairs are `(x0, x1), (x2, x3), ...` and the result is written half-split:
  `cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)` (`apply_rotary_pos_emb_interleave`,
  the same layout change on q and k, so scores are as DeepSeek's); without it Llama's
  rotate_half. Softmax scale `cfg.softmax_scale` (qk_head_dim ** -0.5 times yarn's mscale**2).
- MLP: dense layers (`first_k_dense_replace`) a SwiGLU; MoE layers `models.deepseek_v3.routing`
  (sigmoid router, correction bias for choosing only, group-limited top-k) over the routed
  experts (dense dispatch: every expert on every token, weighted by the routing weights, zero
  for unchosen ones; activations `[tokens, experts, moe_intermediate_size]`, fine at test
  sizes, not for serving), plus the shared SwiGLU on the same input.

Params (fp32, kernels `[in, out]`; H heads; axes in brackets), laid out as `models.moe` says:
  embed.embedding [vocab, embed] (vocab, embed); final_norm.scale [embed] (None);
  lm_head.kernel [embed, vocab] (embed, vocab), untied only.
  layers.* : norms and MLA of all L layers, stacked on a leading `layers` axis (pp):
    attn_norm.scale, mlp_norm.scale [L, embed] (layers, None)
    q.kernel [L, embed, H*qk_head] (layers, embed, heads)                  without q_lora_rank
    q_a.kernel [L, embed, q_lora_rank] (layers, embed, None); q_a_norm.scale [L, q_lora_rank]
    q_b.kernel [L, q_lora_rank, H*qk_head] (layers, None, heads)
    kv_a.kernel [L, embed, kv_lora_rank + qk_rope] (layers, embed, None)
    kv_a_norm.scale [L, kv_lora_rank] (layers, None)
    kv_b.kernel [L, kv_lora_rank, H*(qk_nope + v_head)] (layers, None, heads)
    o.kernel [L, H*v_head, embed] (layers, heads, embed)
    with attention_bias: q_a.bias, kv_a.bias, o.bias (layers, None)
  mlp.{gate,up,down}.kernel: the dense SwiGLU of the Ld = first_k_dense_replace first layers.
  moe.*: the Lm = L - Ld MoE layers: router.kernel [Lm, embed, experts] (layers, embed, None),
    router.bias [Lm, experts] (layers, None) = transformers' `e_score_correction_bias`,
    experts.{gate,up}.kernel [Lm, experts, embed, moe_mlp] (layers, experts, embed, mlp),
    experts.down.kernel [Lm, experts, moe_mlp, embed] (layers, experts, mlp, embed),
    shared.{gate,up,down}.kernel: a SwiGLU of width moe_mlp * n_shared_experts.
  The latent dims (q_lora_rank, kv_lora_rank + qk_rope) are not split: each is RMS-normalised
  whole and the kv latent is shared by every head, so its producer is replicated over tp as in
  Megatron's MLA (NVIDIA/Megatron-LM:megatron/core/transformer/multi_latent_attention.py builds
  `linear_kv_down_proj` as a TELinear with `parallel_mode="duplicated"`); their `[in]` side is
  embed (fsdp) and the up projections q_b / kv_b split heads over tp.
  mtp.* (when the checkpoint carries MTP modules, `cfg.mtp_layers` = n; not used by the forward
  pass): each leaf on a leading axis of the n modules with logical None (not split over pp:
  Megatron runs MTP on the last pipeline stage): embed.embedding [n, vocab, embed],
  enorm.scale, hnorm.scale, head_norm.scale [n, embed], eh_proj.kernel [n, 2*embed, embed]
  (None, None, embed), head.kernel [n, embed, vocab], layers.* and moe.* as above.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hybridckpt.models.common import causal_attention, dense, embedding, output_logits, stacked
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.deepseek_v3.routing import route
from hybridckpt.models.llama.module import RMSNorm, apply_rope
from hybridckpt.models.moe import (
    ParamSpec,
    ParamTree,
    Spec,
    experts_swiglu,
    group_mlp,
    layer_groups,
    moe_spec,
    swiglu,
    swiglu_spec,
)
from hybridckpt.models.rope import rope_tables

LATENT_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, used by q_a_layernorm / kv_a_layernorm


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """transformers' `apply_rotary_pos_emb_interleave`: x `[b, s, h, d]`, pairs (x0, x1), ...
    rotated by one frequency each, written back half-split; cos/sin `[s, d]` (angles repeated
    over halves: the first half is used), cast to x's dtype."""
    half = x.shape[-1] // 2
    cos = cos[None, :, None, :half].astype(x.dtype)
    sin = sin[None, :, None, :half].astype(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mla(cfg: DeepseekV3Config, dt: Any, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Multi-head latent attention of the normed `x` `[b, s, embed]` (inside a compact module:
    the params are its own)."""
    b, s, _ = x.shape
    H, nope, rope, vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    bias = (None,) if cfg.attention_bias else None
    if cfg.q_lora_rank is None:
        q = dense(H * cfg.qk_head_dim, ("embed", "heads"), "q", dt)(x)
    else:
        q = dense(cfg.q_lora_rank, ("embed", None), "q_a", dt, bias_axes=bias)(x)
        q = RMSNorm(LATENT_NORM_EPS, dt, name="q_a_norm")(q)
        q = dense(H * cfg.qk_head_dim, (None, "heads"), "q_b", dt)(q)
    q = q.reshape(b, s, H, cfg.qk_head_dim)
    q_pass, q_rot = q[..., :nope], q[..., nope:]

    kv = dense(cfg.kv_lora_rank + rope, ("embed", None), "kv_a", dt, bias_axes=bias)(x)
    latent, k_rot = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank :]
    latent = RMSNorm(LATENT_NORM_EPS, dt, name="kv_a_norm")(latent)
    k_rot = k_rot.reshape(b, s, 1, rope)
    rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
    q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot, cos, sin)

    kv = dense(H * (nope + vd), (None, "heads"), "kv_b", dt)(latent).reshape(b, s, H, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (b, s, H, rope))], axis=-1)
    q = jnp.concatenate([q_pass, q_rot], axis=-1)
    attn = causal_attention(q, k, v, cfg.softmax_scale).reshape(b, s, H * vd)
    return dense(cfg.hidden_size, ("heads", "embed"), "o", dt, bias_axes=bias)(attn)


def deepseek_moe(cfg: DeepseekV3Config, dt: Any, x: jax.Array, p: dict) -> jax.Array:
    """`DeepseekV3MoE.forward` of the normed `x` `[b, s, embed]` with one layer's `moe` params:
    the routed experts (`models.moe.experts_swiglu`, a dense dispatch) weighted by
    `routing.route`, plus the shared SwiGLU on the same input."""
    shape = x.shape
    h = x.reshape(-1, shape[-1])
    weights = route(cfg, h, p["router"]["kernel"], p["router"]["bias"])
    routed = experts_swiglu(h, weights, p["experts"], dt).reshape(shape)
    return routed + swiglu(x, p["shared"], dt)


class DecoderLayer(nn.Module):
    """One decoder layer: norms and MLA are its own params (scanned: `layers`); its MLP is layer
    `pos` of the `moe` group when `is_moe`, else of the dense `mlp` group (`models.moe`)."""

    cfg: DeepseekV3Config
    dtype: Any

    @nn.compact
    def __call__(self, x, cos, sin, moe, mlp, is_moe, pos):
        cfg, dt = self.cfg, self.dtype
        h = RMSNorm(cfg.rms_norm_eps, dt, name="attn_norm")(x)
        x = x + mla(cfg, dt, h, cos, sin)
        h = RMSNorm(cfg.rms_norm_eps, dt, name="mlp_norm")(x)
        y = group_mlp(
            h,
            is_moe,
            pos,
            moe,
            mlp,
            lambda h, p: deepseek_moe(cfg, dt, h, p),
            lambda h, p: swiglu(h, p, dt),
        )
        return x + y, None


def moe_group_spec(cfg: DeepseekV3Config, n: int) -> Spec:
    """`models.moe.moe_spec` with the router's correction bias, plus the shared SwiGLU."""
    E, M = cfg.hidden_size, cfg.moe_intermediate_size
    spec = moe_spec(n, E, cfg.n_routed_experts, M, router_bias=True)
    return spec + (("shared", swiglu_spec(n, E, M * cfg.n_shared_experts)),)


def _unsplit_leading(spec: Spec) -> Spec:
    """`spec` with logical None on every leading (layer) axis: MTP modules are not split on pp."""
    return tuple(
        (
            name,
            replace(c, axes=(None, *c.axes[1:]))
            if isinstance(c, ParamSpec)
            else _unsplit_leading(c),
        )
        for name, c in spec
    )


class MTP(nn.Module):
    """The params of the MTP modules (DeepSeek-V3 README_WEIGHTS.md: `embed_tokens`, `enorm`,
    `hnorm`, `eh_proj`, a decoder layer, `shared_head.{norm,head}`), each on a leading axis of
    the `n` modules. Called only at init, to create them: the forward pass does not use MTP
    (neither does transformers')."""

    cfg: DeepseekV3Config
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> None:
        cfg, n, E, V = self.cfg, self.cfg.mtp_layers, self.cfg.hidden_size, self.cfg.vocab_size
        own: Spec = (
            ("embed", (("embedding", ParamSpec((n, V, E), (None, "vocab", "embed"))),)),
            ("enorm", (("scale", ParamSpec((n, E), (None, None), "ones")),)),
            ("hnorm", (("scale", ParamSpec((n, E), (None, None), "ones")),)),
            ("eh_proj", (("kernel", ParamSpec((n, 2 * E, E), (None, None, "embed"))),)),
            ("head_norm", (("scale", ParamSpec((n, E), (None, None), "ones")),)),
            ("head", (("kernel", ParamSpec((n, E, V), (None, "embed", "vocab"))),)),
        )
        for name, child in own:
            ParamTree(child, name=name)()
        moe = ParamTree(_unsplit_leading(moe_group_spec(cfg, n)), name="moe")()
        block = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * 4 + (0, 0),
            length=n,
            metadata_params={nn.PARTITION_NAME: None},
        )
        is_moe, pos = jnp.ones((n,), bool), jnp.arange(n, dtype=jnp.int32)
        block(cfg, self.dtype, name="layers")(x, cos, sin, moe, None, is_moe, pos)


class DeepseekV3(nn.Module):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    cfg: DeepseekV3Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        E = cfg.hidden_size
        embed = embedding(cfg.vocab_size, E, "embed", dt)
        x = embed(tokens)
        cos, sin = rope_tables(
            tokens.shape[1],
            cfg.qk_rope_head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            max_position_embeddings=cfg.max_position_embeddings,
        )
        dense_layers, L = cfg.num_dense_layers, cfg.num_layers
        moe = mlp = None  # as jax arrays: a layer's slice is a traced index into them
        if cfg.num_moe_layers:
            moe = ParamTree(moe_group_spec(cfg, cfg.num_moe_layers), name="moe")()
            moe = jax.tree.map(jnp.asarray, moe)
        if dense_layers:
            mlp = ParamTree(swiglu_spec(dense_layers, E, cfg.intermediate_size), name="mlp")()
            mlp = jax.tree.map(jnp.asarray, mlp)
        is_moe, pos = layer_groups(tuple(range(dense_layers, L)), L)
        layers = stacked(DecoderLayer, L, 4, 2)(cfg, dt, name="layers")
        x, _ = layers(x, cos, sin, moe, mlp, is_moe, pos)
        if cfg.mtp_layers and self.is_initializing():
            MTP(cfg, dt, name="mtp")(x, cos, sin)
        x = RMSNorm(cfg.rms_norm_eps, dt, name="final_norm")(x)
        logits = output_logits(x, embed, cfg.vocab_size, cfg.tie_word_embeddings, dt)
        return logits.astype(jnp.float32)
