"""The Gemma 3 text family's params (`models.table`): Gemma 2's rows (`models.gemma2.params`)
plus the per-head q/k norm weights `layers.{q,k}_norm.scale [L, D]` (zero-centred, axes
layers, None), HF Gemma3ForCausalLM names.
"""

from __future__ import annotations

from hybridckpt.models.gemma2.params import ATTENTION, FINAL_NORM, NORMS, norm
from hybridckpt.models.llama.params import ATTN, EMBED, LM_HEAD, MLP, TIED_HEAD, dims, groups
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import ParamTable, stack

QK_NORMS = (
    norm("q_norm", f"{ATTN}.q_norm.weight", "D"),
    norm("k_norm", f"{ATTN}.k_norm.weight", "D"),
)

# Gemma3DecoderLayer: attention (q, k, v, o, q_norm, k_norm), mlp, then its four norms
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
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
    'pre_feedforward_layernorm.weight',
    'post_feedforward_layernorm.weight',
))

TABLE = ParamTable(
    __name__,
    dims,
    (EMBED, *stack("layers", (*NORMS, *ATTENTION, *QK_NORMS, *MLP)), FINAL_NORM, LM_HEAD, TIED_HEAD),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
