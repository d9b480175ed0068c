"""The DeepSeek V3 family's params (`models.table`): HF DeepseekV3ForCausalLM names -> the params
tree (fp32, kernels `[in, out]`), laid out as `models.moe` says: every decoder layer's norms and
MLA attention stacked in `layers` ({decoder_layers} = 0..L-1), the dense MLPs of the first
`first_k_dense_replace` layers in `mlp` ({dense_layers}), the MoE MLPs of the others in `moe`
({moe_layers}; experts on a second axis, per-expert keys as on the Hub and as transformers 5.23
saves them), and the MTP modules `model.layers.{L + i}` in `mtp` ({mtp_layers}; kept through
import and export, unused by the forward pass), each leaf on a leading axis of the modules with
logical None (not split over pp: Megatron runs MTP on the last pipeline stage). A group with no
layer has no params (its dimension is 0) and its rules match nothing.

The latent dims (q_lora_rank, kv_lora_rank + qk_rope) are not split: each is RMS-normalised
whole and the kv latent is shared by every head, so its producer is replicated over tp as in
Megatron's MLA (NVIDIA/Megatron-LM:megatron/core/transformer/multi_latent_attention.py builds
`linear_kv_down_proj` as a TELinear with `parallel_mode="duplicated"`): axes (embed, None);
the up projections q_b / kv_b split heads over tp.

Dimensions: V vocab, E hidden, L layers, Ld / Lm the dense / MoE layers, N the MTP modules,
Q = heads * (qk_nope + qk_rope), QL q_lora_rank, KVL kv_lora_rank, KVA = kv_lora_rank + qk_rope,
KVB = heads * (qk_nope + v_head), VO = heads * v_head, M the dense MLP width, X routed experts,
MX an expert's width, MS the shared experts' (MX * n_shared_experts), E2 = 2 * E.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Drop, Groups, Param, ParamTable, Row, stack, under


def dims(cfg: Any) -> dict[str, int | None]:
    """The size of each dimension symbol of the rows below (QL None without q_lora_rank)."""
    H = cfg.num_heads
    return {
        "V": cfg.vocab_size, "E": cfg.hidden_size, "E2": 2 * cfg.hidden_size,
        "L": cfg.num_layers, "Ld": cfg.num_dense_layers, "Lm": cfg.num_moe_layers,
        "N": cfg.mtp_layers, "Q": H * cfg.qk_head_dim, "QL": cfg.q_lora_rank,
        "KVL": cfg.kv_lora_rank, "KVA": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "KVB": H * (cfg.qk_nope_head_dim + cfg.v_head_dim), "VO": H * cfg.v_head_dim,
        "M": cfg.intermediate_size, "X": cfg.n_routed_experts, "MX": cfg.moe_intermediate_size,
        "MS": cfg.moe_intermediate_size * cfg.n_shared_experts,
    }  # fmt: skip


def groups(cfg: Any) -> dict[str, Groups]:
    """The dimensions made of heads (Q, KVB, VO: MLA's per-head blocks) or of experts (X)."""
    heads = Groups("heads", cfg.num_heads)
    return {"Q": heads, "KVB": heads, "VO": heads, "X": Groups("experts", cfg.n_routed_experts)}


def decoder(i: str) -> tuple[Param, ...]:
    """One decoder layer's norms and MLA (HF layer index `i`: "$L", or "$M" for MTP)."""
    hf = f"model.layers.{i}"
    at = f"{hf}.self_attn"
    return (
        Param("attn_norm.scale", ("E",), (None,), f"{hf}.input_layernorm.weight", init="ones"),
        Param("mlp_norm.scale", ("E",), (None,), f"{hf}.post_attention_layernorm.weight", init="ones"),
        Param("q.kernel", ("E", "Q"), ("embed", "heads"), f"{at}.q_proj.weight", "transpose", when="not q_lora"),
        Param("q_a.kernel", ("E", "QL"), ("embed", None), f"{at}.q_a_proj.weight", "transpose", when="q_lora"),
        Param("q_a.bias", ("QL",), (None,), f"{at}.q_a_proj.bias", when="q_a_bias", init="zeros"),
        Param("q_a_norm.scale", ("QL",), (None,), f"{at}.q_a_layernorm.weight", when="q_lora", init="ones"),
        Param("q_b.kernel", ("QL", "Q"), (None, "heads"), f"{at}.q_b_proj.weight", "transpose", when="q_lora"),
        Param("kv_a.kernel", ("E", "KVA"), ("embed", None), f"{at}.kv_a_proj_with_mqa.weight", "transpose"),
        Param("kv_a.bias", ("KVA",), (None,), f"{at}.kv_a_proj_with_mqa.bias", when="attention_bias", init="zeros"),
        Param("kv_a_norm.scale", ("KVL",), (None,), f"{at}.kv_a_layernorm.weight", init="ones"),
        Param("kv_b.kernel", ("KVL", "KVB"), (None, "heads"), f"{at}.kv_b_proj.weight", "transpose"),
        Param("o.kernel", ("VO", "E"), ("heads", "embed"), f"{at}.o_proj.weight", "transpose"),
        Param("o.bias", ("E",), (None,), f"{at}.o_proj.bias", when="attention_bias", init="zeros"),
    )  # fmt: skip


def moe(i: str) -> tuple[Param, ...]:
    """One MoE layer's MLP: the router with its `e_score_correction_bias`, the routed experts and
    the shared SwiGLU (`moe.shared`)."""
    hf = f"model.layers.{i}.mlp"
    shared = under("shared", mlp_table.swiglu(f"{hf}.shared_experts", "MS"))
    return (*mlp_table.router(f"{hf}.gate", bias=True), *mlp_table.experts(f"{hf}.experts", "MX"), *shared)


def mtp(i: str, layer: Callable[[str], tuple[Param, ...]] = decoder) -> tuple[Row, ...]:
    """One MTP module (deepseek-ai/DeepSeek-V3:README_WEIGHTS.md): its own params, then an MoE
    decoder layer (`layers`: `layer(i)`'s rows, `moe`)."""
    hf = f"model.layers.{i}"
    own = (
        Param("embed.embedding", ("V", "E"), ("vocab", "embed"), f"{hf}.embed_tokens.weight"),
        Param("enorm.scale", ("E",), (None,), f"{hf}.enorm.weight", init="ones"),
        Param("hnorm.scale", ("E",), (None,), f"{hf}.hnorm.weight", init="ones"),
        Param("eh_proj.kernel", ("E2", "E"), (None, "embed"), f"{hf}.eh_proj.weight", "transpose"),
        Param("head_norm.scale", ("E",), (None,), f"{hf}.shared_head.norm.weight", init="ones"),
        Param("head.kernel", ("E", "V"), ("embed", "vocab"), f"{hf}.shared_head.head.weight", "transpose"),
    )
    return (*own, *under("layers", layer(i)), *under("moe", moe(i)))


# a DeepseekV3DecoderLayer's mlp (a dense layer's gate/up/down; a sparse layer's fused experts, gate,
# shared experts) and norms, in transformers' order (GLM-4.5's and DeepSeek V3.2's layers end so too)
MLP_AND_NORMS_ORDER = (
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "mlp.gate.weight",
    "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)

# transformers 5 DeepseekV3DecoderLayer: attention (with or without the q LoRA), mlp (a dense layer's
# gate/up/down; a sparse layer's fused experts, gate, shared experts), norms; in-memory names
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_a_proj.weight',
    'self_attn.q_a_proj.bias',
    'self_attn.q_a_layernorm.weight',
    'self_attn.q_b_proj.weight',
    'self_attn.q_proj.weight',
    'self_attn.kv_a_proj_with_mqa.weight',
    'self_attn.kv_a_proj_with_mqa.bias',
    'self_attn.kv_a_layernorm.weight',
    'self_attn.kv_b_proj.weight',
    'self_attn.o_proj.weight',
    'self_attn.o_proj.bias',
    *MLP_AND_NORMS_ORDER,
))

def table(
    source: str,
    layer: Callable[[str], tuple[Param, ...]] = decoder,
    more_dims: Callable[[Any], dict[str, int | None]] | None = None,
    more_groups: Callable[[Any], dict[str, Groups]] | None = None,
    named_parameters: tuple[str, ...] = NAMED_PARAMETERS,
    layernorms: tuple[str, ...] = (),
) -> ParamTable:
    """The table of a DeepSeek V3 model whose decoder layers (and MTP modules' layers) have
    `layer(i)`'s rows; `more_dims` / `more_groups` add the symbols those rows use (DeepSeek
    V3.2's indexer, `models.deepseek_v32.params`), `layernorms` the `nn.LayerNorm` params among
    them (`ParamTable.layernorms`). `source` names the table in errors."""

    def all_dims(cfg: Any) -> dict[str, int | None]:
        return {**dims(cfg), **(more_dims(cfg) if more_dims else {})}

    def all_groups(cfg: Any) -> dict[str, Groups]:
        return {**groups(cfg), **(more_groups(cfg) if more_groups else {})}

    return ParamTable(source, all_dims, rows(layer), all_groups, named_parameters=named_parameters,
                      layernorms=layernorms)


def rows(layer: Callable[[str], tuple[Param, ...]] = decoder) -> tuple[Row, ...]:
    """Every row of the table (`table`)."""
    return (
        Param("embed.embedding", ("V", "E"), ("vocab", "embed"), "model.embed_tokens.weight"),
        Param("final_norm.scale", ("E",), (None,), "model.norm.weight", init="ones"),
        Param("lm_head.kernel", ("E", "V"), ("embed", "vocab"), "lm_head.weight", "transpose", when="not tied"),
        # a tied model's copy of the embedding (DeepSpeed's shared_params, a DCP state dict):
        # dropped, as transformers ties it on load
        Drop("lm_head.weight", when="tied"),
        *stack("layers", layer("$L"), index="$L in {decoder_layers}"),
        *stack("mlp", mlp_table.swiglu("model.layers.$L.mlp", "M"), dim="Ld", index="$L in {dense_layers}"),
        *stack("moe", moe("$L"), dim="Lm", index="$L in {moe_layers}"),
        *stack("mtp", mtp("$M", layer), dim="N", axis=None, index="$M in {mtp_layers}"),
        # a buffer some writers keep; not a parameter
        Drop("model.layers.$L.self_attn.rotary_emb.inv_freq"),
    )


TABLE = table(__name__)
