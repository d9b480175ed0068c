"""The GPT-OSS family's params (`models.table`): HF GptOssForCausalLM names (transformers'
runtime names, which `save_pretrained` writes and which the MXFP4 reader gives its dequantized
experts, `hybridckpt.formats.hf.quant`) -> the params tree (fp32, kernels `[in, out]`).

Per layer, under `layers` (stacked `[L]`): Llama's norms and q/k/v/o kernels, their biases
(`q.bias [Q]` axes heads, `{k,v}.bias [KV]` kv_heads, `o.bias [E]` replicated; when
`attention_bias`) and `sinks [H]` (axes heads: one learned logit per query head).

Per MoE layer (every layer), under `moe` (stacked `[Lm]`, outside the layer scan, `models.moe`):
  router.kernel          [E, X]          <- mlp.router.weight [X, E] (transposed)
  router.bias            [X]             <- mlp.router.bias
  experts.gate_up.kernel [X, E, 2 * MX]  <- mlp.experts.gate_up_proj (already `[in, out]`;
                                            column 2j is gate j, 2j + 1 up j)
  experts.gate_up.bias   [X, 2 * MX]     <- mlp.experts.gate_up_proj_bias
  experts.down.kernel    [X, MX, E]      <- mlp.experts.down_proj (already `[in, out]`)
  experts.down.bias      [X, E]          <- mlp.experts.down_proj_bias
Taken as they are (no layout op: an MXFP4 release's experts are read box by box through one
transpose of the packed bytes, `lazy.quantized`). Interleaved, the `mlp` axis split over tp
in equal chunks gives each shard gate j and up j together with row j of down (MX divisible by
tp), as OpenAI's interleaving intends; the module splits even and odd columns.

Dimensions: Llama's (`models.llama.params`) plus H heads, X experts, MX an expert's width
(intermediate_size), MX2 = 2 * MX, Lm the MoE layers (all).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.llama import params as llama
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.qwen2.params import K_BIAS, O_BIAS, Q_BIAS, V_BIAS
from hybridckpt.models.table import Groups, Param, ParamTable, stack, when

MLP = f"{llama.LAYER}.mlp"
EXPERTS = f"{MLP}.experts"


def dims(cfg: Any) -> dict[str, int]:
    """Llama's dimensions plus H, X, MX, MX2 (= 2 * MX: gate and up) and Lm."""
    return llama.dims(cfg) | {
        "H": cfg.num_heads,
        "X": cfg.num_experts,
        "MX": cfg.intermediate_size,
        "MX2": 2 * cfg.intermediate_size,
        "Lm": len(cfg.moe_layers),
    }


def groups(cfg: Any) -> dict[str, Groups]:
    """Llama's head dimensions plus H (the sinks: one a head), X (the experts) and MX2 (gate and
    up interleaved column by column: a split keeps each pair whole)."""
    return llama.groups(cfg) | {"H": Groups("heads", cfg.num_heads), "X": Groups("experts", cfg.num_experts),
                                "MX2": Groups("gate_up pairs", cfg.intermediate_size)}


SINKS = Param("sinks", ("H",), ("heads",), f"{llama.ATTN}.sinks")
ATTENTION = (
    llama.ATTN_NORM,
    *llama.ATTENTION,
    *when("attention_bias", (Q_BIAS, K_BIAS, V_BIAS, O_BIAS)),
    SINKS,
    llama.MLP_NORM,
)
ROUTER = (
    Param("router.kernel", ("E", "X"), ("embed", None), f"{MLP}.router.weight", "transpose"),
    Param("router.bias", ("X",), (None,), f"{MLP}.router.bias"),
)
EXPERT_ROWS = (
    Param("experts.gate_up.kernel", ("X", "E", "MX2"), ("experts", "embed", "mlp"), f"{EXPERTS}.gate_up_proj"),
    Param("experts.gate_up.bias", ("X", "MX2"), ("experts", "mlp"), f"{EXPERTS}.gate_up_proj_bias", init="zeros"),
    Param("experts.down.kernel", ("X", "MX", "E"), ("experts", "mlp", "embed"), f"{EXPERTS}.down_proj"),
    Param("experts.down.bias", ("X", "E"), ("experts", None), f"{EXPERTS}.down_proj_bias", init="zeros"),
)  # fmt: skip

# GptOssDecoderLayer: attention (sinks first, each bias after its weight), mlp (router, experts), norms
NAMED_PARAMETERS = _hf_order((
    'self_attn.sinks',
    'self_attn.q_proj.weight',
    'self_attn.q_proj.bias',
    'self_attn.k_proj.weight',
    'self_attn.k_proj.bias',
    'self_attn.v_proj.weight',
    'self_attn.v_proj.bias',
    'self_attn.o_proj.weight',
    'self_attn.o_proj.bias',
    'mlp.router.weight',
    'mlp.router.bias',
    'mlp.experts.gate_up_proj',
    'mlp.experts.gate_up_proj_bias',
    'mlp.experts.down_proj',
    'mlp.experts.down_proj_bias',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", ATTENTION),
        *stack("moe", (*ROUTER, *EXPERT_ROWS), dim="Lm", index="$L in {moe_layers}"),
        llama.FINAL_NORM,
        llama.LM_HEAD,
        llama.TIED_HEAD,
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
