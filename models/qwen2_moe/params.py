"""The Qwen2-MoE family's params (`models.table`), HF Qwen2MoeForCausalLM names (the Hub's
per-expert names, which transformers 5 `save_pretrained` also writes):
- Qwen2's attention and norms (`models.llama.params`, `models.qwen2.params`), the q/k/v biases
  only with `qkv_bias`;
- the MoE layers stacked `[moe layers, ...]` by the index list {moe_layers} (`models.moe`):
  router `moe.router.kernel [Lm, E, X]`, experts `moe.experts.{gate,up,down}.kernel`
  `[Lm, X, ...]` (axis experts), the shared expert `moe.shared.{gate,up}.kernel [Lm, E, MS]` /
  `moe.shared.down.kernel [Lm, MS, E]` (axes embed, mlp: split over tp like a dense MLP) and its
  gate `moe.shared_gate.kernel [Lm, E, 1]` (HF `mlp.shared_expert_gate.weight [1, E]`
  transposed; replicated but the embed dim);
- the dense layers' SwiGLU `mlp.*` stacked apart by {dense_layers}.
Dimensions: Mixtral's (`models.mixtral.params`: X experts, MX an expert's width, Lm / Ld the
MoE / dense layers, M the dense width) plus MS the shared expert's width.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.llama import params as llama
from hybridckpt.models.mixtral import params as mixtral
from hybridckpt.models.qwen2.params import K_BIAS, Q_BIAS, V_BIAS
from hybridckpt.models.table import Param, ParamTable, stack, under, when

MLP = f"{llama.LAYER}.mlp"


def dims(cfg: Any) -> dict[str, int]:
    """Mixtral's dimensions plus MS, the shared expert's width."""
    return mixtral.dims(cfg) | {"MS": cfg.shared_expert_intermediate_size}


ATTENTION = (
    llama.ATTN_NORM,
    llama.Q_PROJ,
    *when("qkv_bias", (Q_BIAS,)),
    llama.K_PROJ,
    *when("qkv_bias", (K_BIAS,)),
    llama.V_PROJ,
    *when("qkv_bias", (V_BIAS,)),
    llama.O_PROJ,
    llama.MLP_NORM,
)
SHARED_GATE = Param(
    "shared_gate.kernel", ("E", 1), ("embed", None), f"{MLP}.shared_expert_gate.weight", "transpose"
)
EXPERTS = (
    *mlp_table.router(f"{MLP}.gate"),
    *mlp_table.experts(f"{MLP}.experts", "MX"),
    *under("shared", mlp_table.swiglu(f"{MLP}.shared_expert", "MS")),
    SHARED_GATE,
)

# transformers 5.24 Qwen2MoeDecoderLayer: self_attn (q, k, v with their biases, o), mlp (a dense
# layer's gate/up/down; a sparse layer's router `gate`, the fused experts, the shared expert and
# its gate), then the norms; in-memory names (`mlp.experts.gate_up_proj`, read back from the Hub's
# per-expert names by `config.hf_name_fixes`)
NAMED_PARAMETERS = llama.hf_order((
    *(f"self_attn.{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias")),
    "self_attn.o_proj.weight",
    *llama.MLP_ORDER,
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    *(n.replace("mlp.", "mlp.shared_expert.") for n in llama.MLP_ORDER),
    "mlp.shared_expert_gate.weight",
    *llama.NORMS_ORDER,
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", ATTENTION),
        *stack("moe", EXPERTS, dim="Lm", index="$L in {moe_layers}"),
        *when(
            "has_dense_layers",
            stack("mlp", mlp_table.swiglu(MLP, "M"), dim="Ld", index="$L in {dense_layers}"),
        ),
        llama.FINAL_NORM,
        llama.LM_HEAD,
        llama.TIED_HEAD,
        llama.INV_FREQ,
    ),
    mixtral.groups,
    named_parameters=NAMED_PARAMETERS,
)
