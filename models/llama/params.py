"""The Llama family's params, declared once (`models.table`): HF LlamaForCausalLM names -> the
params tree (fp32, kernels `[in, out]`, per-layer params stacked on a leading `[L]` axis).

HF/torch Linear weights are `[out, in]`: transpose. Dimensions: V vocab, E hidden, M the SwiGLU
width, L layers, Q = heads * head_dim, KV = kv_heads * head_dim, D head_dim. The rows are
shared by the families built on Llama (Mistral uses this table; Qwen 2/3, Mixtral, Qwen3-MoE
compose theirs from these rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridckpt.models.mlp_table import swiglu
from hybridckpt.models.table import Drop, Groups, Param, ParamTable, stack

LAYER = "model.layers.$L"
ATTN = f"{LAYER}.self_attn"


def dims(cfg: Any) -> dict[str, int]:
    """The size of each dimension symbol of the rows below."""
    return {
        "V": cfg.vocab_size,
        "E": cfg.hidden_size,
        "M": cfg.intermediate_size,
        "L": cfg.num_layers,
        "Q": cfg.num_heads * cfg.head_dim,
        "KV": cfg.num_kv_heads * cfg.head_dim,
        "D": cfg.head_dim,
    }


def groups(cfg: Any) -> dict[str, Groups]:
    """The dimensions made of heads (`models.table`): a mesh axis splits them between heads."""
    return {"Q": Groups("heads", cfg.num_heads), "KV": Groups("kv_heads", cfg.num_kv_heads)}


EMBED = Param("embed.embedding", ("V", "E"), ("vocab", "embed"), "model.embed_tokens.weight")
# one layer's rows (under `layers`, each stacked on [L] by `stack`)
ATTN_NORM = Param("attn_norm.scale", ("E",), (None,), f"{LAYER}.input_layernorm.weight", init="ones")
Q_PROJ = Param("q.kernel", ("E", "Q"), ("embed", "heads"), f"{ATTN}.q_proj.weight", "transpose")
K_PROJ = Param("k.kernel", ("E", "KV"), ("embed", "kv_heads"), f"{ATTN}.k_proj.weight", "transpose")
V_PROJ = Param("v.kernel", ("E", "KV"), ("embed", "kv_heads"), f"{ATTN}.v_proj.weight", "transpose")
O_PROJ = Param("o.kernel", ("Q", "E"), ("heads", "embed"), f"{ATTN}.o_proj.weight", "transpose")
ATTENTION = (Q_PROJ, K_PROJ, V_PROJ, O_PROJ)
MLP_NORM = Param(
    "mlp_norm.scale", ("E",), (None,), f"{LAYER}.post_attention_layernorm.weight", init="ones"
)
MLP = swiglu(f"{LAYER}.mlp", "M")  # gate, up, down
# after the layers
FINAL_NORM = Param("final_norm.scale", ("E",), (None,), "model.norm.weight", init="ones")
LM_HEAD = Param("lm_head.kernel", ("E", "V"), ("embed", "vocab"), "lm_head.weight", "transpose",
                when="not tied")  # fmt: skip
# a tied model's copy of the embedding (DeepSpeed's shared_params, zero_to_fp32, a DCP state
# dict) is the embedding itself: dropped, as transformers ties it on load
TIED_HEAD = Drop("lm_head.weight", when="tied")
# a buffer some writers keep; not a parameter
INV_FREQ = Drop(f"{ATTN}.rotary_emb.inv_freq")



def hf_order(layer: tuple[str, ...], prefix: str = "model.", head: str = "lm_head.weight") -> tuple[str, ...]:
    """transformers' `named_parameters()` order of a decoder-only model (`ParamTable.
    named_parameters`): `{prefix}embed_tokens.weight`, each layer's `layer` names (after
    `{prefix}layers.$.`, in the layer module's definition order), `{prefix}norm.weight`, the head."""
    return (f"{prefix}embed_tokens.weight", *(f"{prefix}layers.$.{n}" for n in layer), f"{prefix}norm.weight", head)


ATTENTION_ORDER = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
MLP_ORDER = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
NORMS_ORDER = ("input_layernorm.weight", "post_attention_layernorm.weight")
# LlamaDecoderLayer: self_attn (q, k, v, o), mlp (gate, up, down), input_layernorm, post_attention_layernorm
NAMED_PARAMETERS = hf_order((*ATTENTION_ORDER, *MLP_ORDER, *NORMS_ORDER))



def decoder_table(
    module: str,
    layer: tuple[Param, ...],
    named_parameters: tuple[str, ...],
    dims_of: Callable[[Any], dict[str, int]] = dims,
    groups_of: Callable[[Any], dict[str, Groups]] = groups,
) -> ParamTable:
    """The table of a family shaped as Llama is, for the module `module`: the embedding, one
    layer's rows `layer` (stacked on [L] under `layers`), the final norm, the untied head, the
    tied head's copy and the RoPE buffer dropped; `named_parameters` in transformers' order
    (`hf_order`), the dimensions and head groups by `dims_of` / `groups_of`."""
    rows = (EMBED, *stack("layers", layer), FINAL_NORM, LM_HEAD, TIED_HEAD, INV_FREQ)
    return ParamTable(module, dims_of, rows, groups_of, named_parameters=named_parameters)


TABLE = decoder_table(__name__, (ATTN_NORM, *ATTENTION, MLP_NORM, *MLP), NAMED_PARAMETERS)
