"""The OLMo 2 family's params (`models.table`), HF Olmo2ForCausalLM names: Llama's rows
(`models.llama.params`) without the pre-norms, plus
- `layers.q_norm.scale [L, Q]` (axes layers, heads) and `layers.k_norm.scale [L, KV]` (layers,
  kv_heads): the q/k RMSNorm weights over the whole projection;
- `layers.post_attn_norm.scale [L, E]` (HF `post_attention_layernorm`) and
  `layers.post_mlp_norm.scale [L, E]` (HF `post_feedforward_layernorm`): the post-norms.
Norms init 1.
"""

from __future__ import annotations

from hybridckpt.models.llama.params import (
    ATTENTION,
    ATTN,
    LAYER,
    MLP,
    decoder_table,
)
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Param

Q_NORM = Param("q_norm.scale", ("Q",), ("heads",), f"{ATTN}.q_norm.weight", init="ones")
K_NORM = Param("k_norm.scale", ("KV",), ("kv_heads",), f"{ATTN}.k_norm.weight", init="ones")
POST_ATTN_NORM = Param(
    "post_attn_norm.scale", ("E",), (None,), f"{LAYER}.post_attention_layernorm.weight", init="ones"
)
POST_MLP_NORM = Param(
    "post_mlp_norm.scale",
    ("E",),
    (None,),
    f"{LAYER}.post_feedforward_layernorm.weight",
    init="ones",
)

# Olmo2DecoderLayer: attention (q, k, v, o, q_norm, k_norm), mlp, post-attention and post-feedforward norms
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
    'post_attention_layernorm.weight',
    'post_feedforward_layernorm.weight',
))

TABLE = decoder_table(__name__, (*ATTENTION, Q_NORM, K_NORM, POST_ATTN_NORM, *MLP, POST_MLP_NORM), NAMED_PARAMETERS)
