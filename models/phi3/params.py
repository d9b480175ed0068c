"""The Phi-3 family's params (`models.table`), HF Phi3ForCausalLM names: Llama's rows
(`models.llama.params`) with the two fused projections kept fused:
- `layers.qkv.kernel [L, E, Q + 2 KV]` (axes layers, embed, heads) from `self_attn.qkv_proj`
  `[Q + 2 KV, E]`, transposed: columns q | k | v. Sharded over tp as one axis, a shard holds a
  contiguous run of columns (which may straddle q, k and v); the forward slices it, XLA moves
  what a slice needs.
- `layers.gate_up.kernel [L, E, 2, M]` (layers, embed, None, mlp) from `mlp.gate_up_proj`
  `[2 M, E]`: transposed, then the 2 M columns unflattened to [2, M] (row 0 gate, row 1 up), so
  tp shards the MLP width of each.
The export is the rules' inverse (flatten, transpose): the fused HF tensors come back bitwise.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.llama.params import (
    ATTN,
    ATTN_NORM,
    LAYER,
    MLP_NORM,
    O_PROJ,
    decoder_table,
)
from hybridckpt.models.llama.params import dims as llama_dims
from hybridckpt.models.llama.params import groups as llama_groups
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Groups, Param


def dims(cfg: Any) -> dict[str, int]:
    """Llama's dimension symbols plus QKV = Q + 2 KV (the fused projection's width)."""
    d = llama_dims(cfg)
    return d | {"QKV": d["Q"] + 2 * d["KV"]}


def groups(cfg: Any) -> dict[str, Groups]:
    """Llama's head dimensions plus QKV: the q heads, then the k and the v heads, head-major."""
    return llama_groups(cfg) | {"QKV": Groups("qkv_heads", cfg.num_heads + 2 * cfg.num_kv_heads)}


QKV = Param("qkv.kernel", ("E", "QKV"), ("embed", "heads"), f"{ATTN}.qkv_proj.weight", "transpose")
GATE_UP = Param("gate_up.kernel", ("E", 2, "M"), ("embed", None, "mlp"),
                f"{LAYER}.mlp.gate_up_proj.weight", "transpose, unflatten(1, 2, -1)")  # fmt: skip
DOWN = Param(
    "down.kernel", ("M", "E"), ("mlp", "embed"), f"{LAYER}.mlp.down_proj.weight", "transpose"
)

# Phi3Attention defines o_proj before qkv_proj
NAMED_PARAMETERS = _hf_order((
    'self_attn.o_proj.weight',
    'self_attn.qkv_proj.weight',
    'mlp.gate_up_proj.weight',
    'mlp.down_proj.weight',
    'input_layernorm.weight',
    'post_attention_layernorm.weight',
))

TABLE = decoder_table(__name__, (ATTN_NORM, QKV, O_PROJ, MLP_NORM, GATE_UP, DOWN), NAMED_PARAMETERS, dims, groups)
