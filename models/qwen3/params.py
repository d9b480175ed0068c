"""The Qwen3 (dense) family's params (`models.table`): Llama's rows (`models.llama.params`)
plus the per-head q/k RMSNorm scales `layers.{q,k}_norm.scale [L, D]` (axes layers, None;
init 1) and, with `attention_bias`, Qwen2's biases on q, k, v and o (`models.qwen2.params`),
HF Qwen3ForCausalLM names.
"""

from __future__ import annotations

from hybridckpt.models.llama.params import (
    ATTENTION,
    ATTN,
    ATTN_NORM,
    MLP,
    MLP_NORM,
    decoder_table,
)
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.qwen2.params import K_BIAS, O_BIAS, Q_BIAS, V_BIAS
from hybridckpt.models.table import Param, when

Q_NORM = Param("q_norm.scale", ("D",), (None,), f"{ATTN}.q_norm.weight", init="ones")
K_NORM = Param("k_norm.scale", ("D",), (None,), f"{ATTN}.k_norm.weight", init="ones")
BIASES = when("attention_bias", (Q_BIAS, K_BIAS, V_BIAS, O_BIAS))

# Qwen3Attention: q, k, v, o (each bias after its weight), then q_norm, k_norm
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_proj.weight',
    'self_attn.q_proj.bias',
    'self_attn.k_proj.weight',
    'self_attn.k_proj.bias',
    'self_attn.v_proj.weight',
    'self_attn.v_proj.bias',
    'self_attn.o_proj.weight',
    'self_attn.o_proj.bias',
    'self_attn.q_norm.weight',
    'self_attn.k_norm.weight',
    'mlp.gate_proj.weight',
    'mlp.up_proj.weight',
    'mlp.down_proj.weight',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = decoder_table(__name__, (ATTN_NORM, *ATTENTION, Q_NORM, K_NORM, *BIASES, MLP_NORM, *MLP), NAMED_PARAMETERS)
