"""The Qwen3-Next family's params (`models.table`), HF Qwen3NextForCausalLM names (what
transformers 5.24's `save_pretrained` writes: per-expert tensors, as Qwen3-MoE):

  layers.{attn_norm,mlp_norm}.scale  [L, E]        every layer's (1+w) RMSNorms (init 0)
  attn.*                             [La, ...]     the full-attention layers ({attention_layers}):
    q.kernel [E, Q2] (per head [q_h; gate_h], Q2 = 2 heads head_dim, split on heads),
    k.kernel / v.kernel [E, KV], o.kernel [Q, E], {q,k}_norm.scale [D] ((1+w), init 0)
  linear.*                           [Ll, ...]     the gated delta net layers ({linear_layers}):
    qkvz.kernel [E, QKVZ] (per key head [q; k; v; z], split on key heads),
    ba.kernel [E, BA] (per key head [b; a]), conv.weight [CD, 1, K] as stored (depthwise
    kernel over the channels [q | k | v], replicated), dt_bias, A_log [NV],
    norm.scale [DV] (the gated norm's plain weight, init 1), out.kernel [VD, E] (split on value heads)
  moe.*                              [Lm, ...]     router, experts (`models.mlp_table`), the shared
    expert `shared.{gate,up,down}.kernel` (width MS) and its gate `shared_gate.kernel [E, 1]`
  mlp.*                              [Ld, ...]     dense SwiGLU layers (`mlp_only_layers`)
  embed, final_norm ((1+w), init 0), lm_head

Dimensions: Qwen3-MoE's (`models.mixtral.params`) plus La / Ll the attention / linear layers,
Q2, NK / NV the delta net's key / value heads, DK / DV their widths, QKVZ = NK (2 DK + 2 DV NV/NK),
BA = 2 NV, CD = 2 NK DK + NV DV the conv channels, VD = NV DV, K the conv width, MS the shared
expert's width.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.llama import params as llama
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.mixtral import params as mixtral
from hybridckpt.models.table import Groups, Param, ParamTable, stack, when

LAYER = llama.LAYER
ATTN = llama.ATTN
LIN = f"{LAYER}.linear_attn"
MLP = f"{LAYER}.mlp"


def dims(cfg: Any) -> dict[str, int]:
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return mixtral.dims(cfg) | {
        "La": len(cfg.attention_layers), "Ll": len(cfg.linear_layers), "Q2": 2 * cfg.num_heads * cfg.head_dim,
        "NV": nv, "DV": dv, "QKVZ": nk * (2 * dk + 2 * dv * nv // nk), "BA": 2 * nv, "CD": 2 * nk * dk + nv * dv,
        "VD": nv * dv, "K": cfg.linear_conv_kernel_dim, "MS": cfg.shared_expert_intermediate_size,
    }  # fmt: skip


def groups(cfg: Any) -> dict[str, Groups]:
    """Qwen3-MoE's plus the gated q (per query head), the delta net's projections (per key
    head) and its output (per value head)."""
    nk = cfg.linear_num_key_heads
    return mixtral.groups(cfg) | {
        "Q2": Groups("heads", cfg.num_heads),
        "QKVZ": Groups("heads", nk),
        "BA": Groups("heads", nk),
        "VD": Groups("heads", cfg.linear_num_value_heads),
    }


def _zero_centred(p: Param) -> Param:
    return replace(p, init="zeros")


NORMS = (_zero_centred(llama.ATTN_NORM), _zero_centred(llama.MLP_NORM))
ATTENTION = (
    Param("q.kernel", ("E", "Q2"), ("embed", "heads"), f"{ATTN}.q_proj.weight", "transpose"),
    llama.K_PROJ,
    llama.V_PROJ,
    llama.O_PROJ,
    Param("q_norm.scale", ("D",), (None,), f"{ATTN}.q_norm.weight", init="zeros"),
    Param("k_norm.scale", ("D",), (None,), f"{ATTN}.k_norm.weight", init="zeros"),
)
LINEAR = (
    Param(
        "qkvz.kernel", ("E", "QKVZ"), ("embed", "heads"), f"{LIN}.in_proj_qkvz.weight", "transpose"
    ),
    Param("ba.kernel", ("E", "BA"), ("embed", "heads"), f"{LIN}.in_proj_ba.weight", "transpose"),
    Param("conv.weight", ("CD", 1, "K"), (None, None, None), f"{LIN}.conv1d.weight"),
    Param("dt_bias", ("NV",), (None,), f"{LIN}.dt_bias", init="ones"),
    Param("A_log", ("NV",), (None,), f"{LIN}.A_log", init="zeros"),
    Param("norm.scale", ("DV",), (None,), f"{LIN}.norm.weight", init="ones"),
    Param("out.kernel", ("VD", "E"), ("heads", "embed"), f"{LIN}.out_proj.weight", "transpose"),
)
MOE = (
    *mlp_table.router(f"{MLP}.gate"),
    *mlp_table.experts(f"{MLP}.experts", "MX"),
    *(replace(p, path=f"shared.{p.path}") for p in mlp_table.swiglu(f"{MLP}.shared_expert", "MS")),
    Param(
        "shared_gate.kernel",
        ("E", 1),
        ("embed", None),
        f"{MLP}.shared_expert_gate.weight",
        "transpose",
    ),
)

# transformers 5 Qwen3NextDecoderLayer: its one attention (the gated delta net `linear_attn`, its own
# dt_bias and A_log before its submodules', or `self_attn`), mlp (a dense layer's gate/up/down; a
# sparse layer's router `gate` before the fused experts, then the shared expert and its gate),
# norms; in-memory names (the experts fused: `hf_name_fixes`)
NAMED_PARAMETERS = _hf_order((
    'linear_attn.dt_bias',
    'linear_attn.A_log',
    'linear_attn.conv1d.weight',
    'linear_attn.in_proj_qkvz.weight',
    'linear_attn.in_proj_ba.weight',
    'linear_attn.norm.weight',
    'linear_attn.out_proj.weight',
    *llama.ATTENTION_ORDER,
    'self_attn.q_norm.weight',
    'self_attn.k_norm.weight',
    *llama.MLP_ORDER,
    'mlp.gate.weight',
    'mlp.experts.gate_up_proj',
    'mlp.experts.down_proj',
    'mlp.shared_expert.gate_proj.weight',
    'mlp.shared_expert.up_proj.weight',
    'mlp.shared_expert.down_proj.weight',
    'mlp.shared_expert_gate.weight',
    *llama.NORMS_ORDER,
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", NORMS),
        *stack("attn", ATTENTION, dim="La", index="$L in {attention_layers}"),
        *stack("linear", LINEAR, dim="Ll", index="$L in {linear_layers}"),
        *stack("moe", MOE, dim="Lm", index="$L in {moe_layers}"),
        *when(
            "has_dense_layers",
            stack("mlp", mlp_table.swiglu(MLP, "M"), dim="Ld", index="$L in {dense_layers}"),
        ),
        _zero_centred(llama.FINAL_NORM),
        llama.LM_HEAD,
        llama.TIED_HEAD,
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
