"""The Mixtral family's params (`models.table`): Llama's attention and norms
(`models.llama.params`) and, as every layer's MLP, a router and per-expert SwiGLUs stacked on
`[layers, experts]` (`models.moe`), HF MixtralForCausalLM names: the Hub's per-expert names,
which transformers 5 `save_pretrained` also writes (its fused in-memory `mlp.experts.gate_up_proj`
is converted back on save; `config.hf_name_fixes` renames a file that holds it).

Per layer: router `block_sparse_moe.gate` `[X, E]`; per expert w1 (gate), w3 (up) `[MX, E]`
and w2 (down) `[E, MX]`. Dimensions: Llama's plus X experts, MX an expert's width, Lm / Ld the
MoE / dense-MLP layers (Mixtral: all MoE; Qwen3-MoE's `params` reuses these).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models import mlp_table
from hybridckpt.models.llama import params as llama
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Groups, ParamTable, stack

MOE = f"{llama.LAYER}.block_sparse_moe"


def dims(cfg: Any) -> dict[str, int]:
    """Llama's dimensions plus the MoE groups' (`MixtralConfig` and `Qwen3MoeConfig`)."""
    return llama.dims(cfg) | {
        "X": cfg.num_experts,
        "MX": cfg.expert_intermediate_size,
        "Lm": len(cfg.moe_layers),
        "Ld": len(cfg.dense_layers),
    }


def groups(cfg: Any) -> dict[str, Groups]:
    """Llama's head dimensions plus X, the experts (`models.table`)."""
    return llama.groups(cfg) | {"X": Groups("experts", cfg.num_experts)}


ATTENTION = (llama.ATTN_NORM, *llama.ATTENTION, llama.MLP_NORM)
EXPERTS = (*mlp_table.router(f"{MOE}.gate"), *mlp_table.experts(f"{MOE}.experts", "MX", ("w1", "w3", "w2")))

# transformers 5 MixtralDecoderLayer: attention, mlp (gate, then the fused experts), norms; the
# names are the in-memory ones (`mlp.experts.gate_up_proj`), not the Hub's per-expert files'
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_proj.weight',
    'self_attn.k_proj.weight',
    'self_attn.v_proj.weight',
    'self_attn.o_proj.weight',
    'mlp.gate.weight',
    'mlp.experts.gate_up_proj',
    'mlp.experts.down_proj',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", ATTENTION),
        *stack("moe", EXPERTS, dim="Lm"),
        llama.FINAL_NORM,
        llama.LM_HEAD,
        llama.TIED_HEAD,
        llama.INV_FREQ,
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
