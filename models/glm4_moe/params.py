"""The GLM-4.5 family's params (`models.table`): HF Glm4MoeForCausalLM names -> the params tree
(fp32, kernels `[in, out]`), laid out as `models.moe` says: every decoder layer's norms and GQA
attention stacked in `layers` ({decoder_layers} = 0..L-1), the dense MLPs of the first
`first_k_dense_replace` layers in `mlp` ({dense_layers}), the MoE MLPs of the others in `moe`
({moe_layers}: the router with its `e_score_correction_bias` (`router.bias`), the experts on a
second axis under the Hub's per-expert names, which transformers 5.24 also saves, and the shared
SwiGLU `moe.shared`), and the MTP modules `model.layers.{L + i}` in `mtp` ({mtp_layers}; DeepSeek
V3's layout, `models.deepseek_v3.params.mtp`'s own rows, kept through import and export, unused
by the forward pass; on a leading axis with logical None). A group with no layer has no params
(its dimension is 0) and its rules match nothing.

Heads: q `[E, Q]` and its bias split over tp between heads (`Groups("heads")`), k / v and their
biases between kv heads; the per-head q/k norm scales `[D]` are replicated. Experts over the
`experts` logical axis (`hybridckpt.mesh`).

Dimensions: V vocab, E hidden, E2 = 2 E, L layers, Ld / Lm the dense / MoE layers, N the MTP
modules, Q = heads * head_dim, KV = kv_heads * head_dim, D head_dim, M the dense MLP width, X
routed experts, MX an expert's width, MS the shared SwiGLU's (MX * n_shared_experts).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.deepseek_v3 import params as deepseek
from hybridckpt.models.llama.params import hf_order
from hybridckpt.models.table import Drop, Groups, Param, ParamTable, Row, stack, under


def dims(cfg: Any) -> dict[str, int]:
    """The size of each dimension symbol of the rows below."""
    return {
        "V": cfg.vocab_size, "E": cfg.hidden_size, "E2": 2 * cfg.hidden_size,
        "L": cfg.num_layers, "Ld": cfg.num_dense_layers, "Lm": cfg.num_moe_layers,
        "N": cfg.mtp_layers, "Q": cfg.num_heads * cfg.head_dim,
        "KV": cfg.num_kv_heads * cfg.head_dim, "D": cfg.head_dim, "M": cfg.intermediate_size,
        "X": cfg.n_routed_experts, "MX": cfg.moe_intermediate_size,
        "MS": cfg.moe_intermediate_size * cfg.n_shared_experts,
    }  # fmt: skip


def groups(cfg: Any) -> dict[str, Groups]:
    """The dimensions made of heads (Q), kv heads (KV) or experts (X)."""
    return {"Q": Groups("heads", cfg.num_heads), "KV": Groups("kv_heads", cfg.num_kv_heads),
            "X": Groups("experts", cfg.n_routed_experts)}  # fmt: skip


def decoder(i: str) -> tuple[Param, ...]:
    """One decoder layer's norms and attention (HF layer index `i`: "$L", or "$M" for MTP)."""
    hf = f"model.layers.{i}"
    at = f"{hf}.self_attn"
    return (
        Param("attn_norm.scale", ("E",), (None,), f"{hf}.input_layernorm.weight", init="ones"),
        Param("q.kernel", ("E", "Q"), ("embed", "heads"), f"{at}.q_proj.weight", "transpose"),
        Param("q.bias", ("Q",), ("heads",), f"{at}.q_proj.bias", when="attention_bias", init="zeros"),
        Param("k.kernel", ("E", "KV"), ("embed", "kv_heads"), f"{at}.k_proj.weight", "transpose"),
        Param("k.bias", ("KV",), ("kv_heads",), f"{at}.k_proj.bias", when="attention_bias", init="zeros"),
        Param("v.kernel", ("E", "KV"), ("embed", "kv_heads"), f"{at}.v_proj.weight", "transpose"),
        Param("v.bias", ("KV",), ("kv_heads",), f"{at}.v_proj.bias", when="attention_bias", init="zeros"),
        Param("q_norm.scale", ("D",), (None,), f"{at}.q_norm.weight", when="qk_norm", init="ones"),
        Param("k_norm.scale", ("D",), (None,), f"{at}.k_norm.weight", when="qk_norm", init="ones"),
        Param("o.kernel", ("Q", "E"), ("heads", "embed"), f"{at}.o_proj.weight", "transpose"),
        Param("mlp_norm.scale", ("E",), (None,), f"{hf}.post_attention_layernorm.weight", init="ones"),
    )  # fmt: skip


def moe(i: str) -> tuple[Param, ...]:
    """One MoE layer's MLP: DeepSeek V3's rows (router with `e_score_correction_bias`, routed
    experts, shared SwiGLU `moe.shared`), the same HF names."""
    return deepseek.moe(i)


def mtp(i: str) -> tuple[Row, ...]:
    """One MTP module: DeepSeek V3's own rows (embed_tokens, enorm, hnorm, eh_proj, shared_head),
    then an MoE decoder layer (`layers`, `moe`)."""
    own = tuple(r for r in deepseek.mtp(i) if not r.path.startswith(("layers.", "moe.")))
    return (*own, *under("layers", decoder(i)), *under("moe", moe(i)))


# transformers 5.24 Glm4MoeDecoderLayer: self_attn (q, k, v with their biases, o, the q/k norms),
# mlp (a dense layer's gate/up/down; a sparse layer's fused experts, router `gate`, shared
# experts), then the norms; in-memory names (`mlp.experts.gate_up_proj`: DeepSeek V3's
# `hf_name_fixes`). Left out, as DeepSeek V3's: the router's `e_score_correction_bias`, a BUFFER
# of transformers' module (no index of an optimizer), and the MTP modules `model.layers.{L + i}`
# transformers does not build: an index-keyed state of names holding them is refused
# (`optim.param_order`: not placed), not guessed
NAMED_PARAMETERS = hf_order((
    *(f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")),
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    *deepseek.MLP_AND_NORMS_ORDER,
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        Param("embed.embedding", ("V", "E"), ("vocab", "embed"), "model.embed_tokens.weight"),
        Param("final_norm.scale", ("E",), (None,), "model.norm.weight", init="ones"),
        Param("lm_head.kernel", ("E", "V"), ("embed", "vocab"), "lm_head.weight", "transpose", when="not tied"),
        # a tied model's copy of the embedding: dropped, as transformers ties it on load
        Drop("lm_head.weight", when="tied"),
        *stack("layers", decoder("$L"), index="$L in {decoder_layers}"),
        *stack("mlp", mlp_table.swiglu("model.layers.$L.mlp", "M"), dim="Ld", index="$L in {dense_layers}"),
        *stack("moe", moe("$L"), dim="Lm", index="$L in {moe_layers}"),
        *stack("mtp", mtp("$M"), dim="N", axis=None, index="$M in {mtp_layers}"),
        # a buffer some writers keep; not a parameter
        Drop("model.layers.$L.self_attn.rotary_emb.inv_freq"),
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
