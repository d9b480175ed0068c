"""The Qwen3-MoE family's params (`models.table`): Qwen3's attention and norms (with per-head
q/k norms, `models.qwen3.params`), a router and per-expert SwiGLUs for the MoE layers stacked
`[moe layers, experts]` by the index list {moe_layers}, and the dense SwiGLU of the other layers
({dense_layers}, from `mlp_only_layers` / `decoder_sparse_step`) stacked apart (`models.moe`),
HF Qwen3MoeForCausalLM names: the Hub's per-expert names, which transformers 5
`save_pretrained` also writes. Router `mlp.gate` `[X, E]`. Dimensions as Mixtral's
(`models.mixtral.params`): the dense layers' width is M, an expert's MX.
"""

from __future__ import annotations

from hybridckpt.models import mlp_table
from hybridckpt.models.llama import params as llama
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.mixtral.params import dims, groups
from hybridckpt.models.qwen3.params import K_NORM, Q_NORM
from hybridckpt.models.table import ParamTable, stack, when

MLP = f"{llama.LAYER}.mlp"
ATTENTION = (llama.ATTN_NORM, *llama.ATTENTION, Q_NORM, K_NORM, llama.MLP_NORM)
EXPERTS = (*mlp_table.router(f"{MLP}.gate"), *mlp_table.experts(f"{MLP}.experts", "MX"))

# transformers 5 Qwen3MoeDecoderLayer: attention (q, k, v, o, q_norm, k_norm), mlp (a dense layer's
# gate/up/down, a sparse layer's fused experts, then its gate), norms; in-memory names
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_proj.weight',
    'self_attn.k_proj.weight',
    'self_attn.v_proj.weight',
    'self_attn.o_proj.weight',
    'self_attn.q_norm.weight',
    'self_attn.k_norm.weight',
    'mlp.gate_proj.weight',
    'mlp.up_proj.weight',
    'mlp.down_proj.weight',
    'mlp.experts.gate_up_proj',
    'mlp.experts.down_proj',
    'mlp.gate.weight',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = ParamTable(
    __name__,
    dims,
    (
        llama.EMBED,
        *stack("layers", ATTENTION),
        *stack("moe", EXPERTS, dim="Lm", index="$L in {moe_layers}"),
        *when("has_dense_layers", stack("mlp", mlp_table.swiglu(MLP, "M"), dim="Ld", index="$L in {dense_layers}")),
        llama.FINAL_NORM,
        llama.LM_HEAD,
        llama.TIED_HEAD,
        llama.INV_FREQ,
    ),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
