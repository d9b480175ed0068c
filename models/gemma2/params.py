"""The Gemma 2 family's params (`models.table`): HF Gemma2ForCausalLM names -> the params tree
(fp32, kernels `[in, out]`, every layer, local or global, stacked on one leading `[L]` axis).

Four norms per layer instead of Llama's two; every norm weight moves as stored (zero-centred:
the module scales by 1 + w, so a fresh one is 0). No `rotary_emb.inv_freq` buffer. Gemma 3
(`models.gemma3.params`) adds per-head q/k norms. Dimensions as Llama's (`models.llama.params`).
"""

from __future__ import annotations

from hybridckpt.models.llama.params import (
    ATTENTION,
    EMBED,
    LAYER,
    LM_HEAD,
    MLP,
    TIED_HEAD,
    dims,
    groups,
)
from hybridckpt.models.llama.params import hf_order as _hf_order
from hybridckpt.models.table import Param, ParamTable, stack


def norm(path: str, hf: str, size: str = "E") -> Param:
    """A zero-centred norm weight `[size]` (axes None; init 0)."""
    return Param(f"{path}.scale", (size,), (None,), hf, init="zeros")


NORMS = (
    norm("attn_norm", f"{LAYER}.input_layernorm.weight"),
    norm("attn_out_norm", f"{LAYER}.post_attention_layernorm.weight"),
    norm("mlp_norm", f"{LAYER}.pre_feedforward_layernorm.weight"),
    norm("mlp_out_norm", f"{LAYER}.post_feedforward_layernorm.weight"),
)
FINAL_NORM = norm("final_norm", "model.norm.weight")

# Gemma2DecoderLayer: attention, mlp, then its four norms
NAMED_PARAMETERS = _hf_order((
    'self_attn.q_proj.weight',
    'self_attn.k_proj.weight',
    'self_attn.v_proj.weight',
    'self_attn.o_proj.weight',
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
    (EMBED, *stack("layers", (*NORMS, *ATTENTION, *MLP)), FINAL_NORM, LM_HEAD, TIED_HEAD),
    groups,
    named_parameters=NAMED_PARAMETERS,
)
