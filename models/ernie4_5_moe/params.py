"""The ERNIE 4.5 MoE family's params (`models.table`): the dense family's attention and norms
(`models.ernie4_5.params`, biases with `use_bias`) in `layers`; the dense layers' SwiGLU (and
biases) in `mlp` ({dense_layers}); in `moe` ({moe_layers}, `models.moe`): the router `mlp.gate`
`[X, E]`, its correction bias `router.bias` `[1, X]` as stored (`mlp.moe_statics.
e_score_correction_bias`, replicated), the experts per expert (the Hub's names, which transformers
5.24 saves too; no biases) and, with shared experts, `moe.shared` (width MS, biases with
`use_bias`); the MTP modules in `mtp` ({mtp_layers}: `emb_norm`, `hidden_norm`, `linear_proj`
`[2E, E]` and a dense decoder layer `mtp.layers.*` from `model.mtp_block.$M.*`; on a leading axis
with logical None, kept through import and export, unused by the forward pass); a group with no layer or no width (no dense layer, no shared expert) has no params
(a dimension of size 0); `lm_head.bias` `[V]` with `use_bias` (tied or not).

Dimensions: Llama's (`models.llama.params.dims`) plus X experts, MX an expert's width, MS the
shared SwiGLU's (MX * moe_num_shared_experts), Lm / Ld the MoE / dense layers, N the MTP modules,
E2 = 2 E.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.ernie4_5.params import ATTENTION_BIASES, mlp_biases, with_biases
from hybridckpt.models.llama import params as llama
from hybridckpt.models.table import Groups, Param, ParamTable, stack, under

MLP = f"{llama.LAYER}.mlp"


def dims(cfg: Any) -> dict[str, int]:
    return llama.dims(cfg) | {
        "X": cfg.moe_num_experts, "MX": cfg.moe_intermediate_size,
        "MS": cfg.moe_intermediate_size * cfg.moe_num_shared_experts,
        "Lm": len(cfg.moe_layers), "Ld": len(cfg.dense_layers), "N": cfg.mtp_layers, "E2": 2 * cfg.hidden_size,
    }  # fmt: skip


def groups(cfg: Any) -> dict[str, Groups]:
    return llama.groups(cfg) | {"X": Groups("experts", cfg.moe_num_experts)}


ATTENTION = (llama.ATTN_NORM, *llama.ATTENTION, *ATTENTION_BIASES, llama.MLP_NORM)
SHARED = f"{MLP}.shared_experts"
MOE = (
    Param("router.kernel", ("E", "X"), ("embed", None), f"{MLP}.gate.weight", "transpose"),
    Param("router.bias", (1, "X"), (None, None), f"{MLP}.moe_statics.e_score_correction_bias", init="zeros"),
    *mlp_table.experts(f"{MLP}.experts", "MX"),
    *under("shared", (*mlp_table.swiglu(SHARED, "MS"), *mlp_biases(SHARED, "MS"))),
)
DENSE = (*mlp_table.swiglu(MLP, "M"), *mlp_biases(MLP, "M"))
MTP_BLOCK = "model.mtp_block.$M"
MTP = (  # one MTP module (config docstring): its own params, then a dense decoder layer
    Param("emb_norm.scale", ("E",), (None,), "model.mtp_emb_norm.$M.weight", init="ones"),
    Param("hidden_norm.scale", ("E",), (None,), "model.mtp_hidden_norm.$M.weight", init="ones"),
    Param("linear_proj.kernel", ("E2", "E"), (None, "embed"), "model.mtp_linear_proj.$M.weight", "transpose"),
    *(replace(r, path=f"layers.{r.path}", hf=r.hf.replace(llama.LAYER, MTP_BLOCK)) for r in (*ATTENTION, *DENSE)),
)
LM_HEAD_BIAS = Param("lm_head.bias", ("V",), ("vocab",), "lm_head.bias", when="use_bias", init="zeros")

# transformers 5.24 Ernie4_5_MoeDecoderLayer: self_attn (each Linear's weight then bias), mlp (a
# dense layer's gate, up, down; a sparse layer's router `gate.weight`, the fused experts, the
# shared experts), then the norms; in-memory names (`mlp.experts.gate_up_proj`, read back from the
# Hub's per-expert names by `config.hf_name_fixes`); `lm_head.bias` after the head. Left out: the
# router's `mlp.gate.moe_statics.e_score_correction_bias`, a parameter of transformers' module
# that is frozen (requires_grad=False): the Trainer leaves it out of its optimizer, a plain
# `AdamW(model.parameters())` puts it in, so no one rule numbers the others; an index-keyed state
# naming it is refused (`optim.param_order`: not placed), as are the MTP modules transformers
# does not build (`model.mtp_*`)
NAMED_PARAMETERS = (*llama.hf_order((
    *with_biases(llama.ATTENTION_ORDER),
    *with_biases(llama.MLP_ORDER),
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    *with_biases(tuple(n.replace("mlp.", "mlp.shared_experts.") for n in llama.MLP_ORDER)),
    *llama.NORMS_ORDER,
)), "lm_head.bias")

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", ATTENTION),
        *stack("moe", MOE, dim="Lm", index="$L in {moe_layers}"),
        *stack("mlp", DENSE, dim="Ld", index="$L in {dense_layers}"),
        *stack("mtp", MTP, dim="N", axis=None, index="$M in {mtp_layers}"),
        llama.FINAL_NORM,
        llama.LM_HEAD,
        LM_HEAD_BIAS,
        llama.TIED_HEAD,
        llama.INV_FREQ,
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
