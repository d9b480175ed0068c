"""The Qwen2 / Qwen2.5 family's params (`models.table`): Llama's rows (`models.llama.params`)
plus the biases of q_proj, k_proj and v_proj (o_proj has none), HF Qwen2ForCausalLM names.

Biases: `layers.q.bias [L, Q]` (axes layers, heads), `layers.{k,v}.bias [L, KV]` (layers,
kv_heads), init 0.
"""

from __future__ import annotations

from hybridckpt.models.llama.params import (
    ATTN,
    ATTN_NORM,
    K_PROJ,
    MLP,
    MLP_NORM,
    O_PROJ,
    Q_PROJ,
    V_PROJ,
    decoder_table,
)
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Param

Q_BIAS = Param("q.bias", ("Q",), ("heads",), f"{ATTN}.q_proj.bias", init="zeros")
K_BIAS = Param("k.bias", ("KV",), ("kv_heads",), f"{ATTN}.k_proj.bias", init="zeros")
V_BIAS = Param("v.bias", ("KV",), ("kv_heads",), f"{ATTN}.v_proj.bias", init="zeros")
O_BIAS = Param("o.bias", ("E",), (None,), f"{ATTN}.o_proj.bias", init="zeros")  # Qwen3's

# Qwen2DecoderLayer: Llama's, with q/k/v biases after their weights
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_proj.weight',
    'self_attn.q_proj.bias',
    'self_attn.k_proj.weight',
    'self_attn.k_proj.bias',
    'self_attn.v_proj.weight',
    'self_attn.v_proj.bias',
    'self_attn.o_proj.weight',
    'mlp.gate_proj.weight',
    'mlp.up_proj.weight',
    'mlp.down_proj.weight',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = decoder_table(__name__, (ATTN_NORM, Q_PROJ, Q_BIAS, K_PROJ, K_BIAS, V_PROJ, V_BIAS, O_PROJ, MLP_NORM, *MLP), NAMED_PARAMETERS)
