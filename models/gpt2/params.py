"""The GPT-2 family's params (`models.table`): HF GPT2LMHeadModel names -> the params tree
(fp32, kernels `[in, out]`, per-layer params stacked on a leading `[L]` axis).

GPT-2's Conv1D weights are already `[in, out]`; c_attn `[E, 3E]` holds q | k | v blocks and
becomes `[E, 3, E]` (axis 1 = q, k, v; the last axis head-major heads * head_dim), its bias
`[3E]` becomes `[3, E]`. The head is tied to `wte`. Dimensions: V vocab, P n_positions, E n_embd,
I n_inner, L n_layer, EH n_embd seen as n_head heads of n_embd / n_head (the attention's
head dimensions, which a mesh axis splits only between heads).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.table import Drop, Groups, Param, ParamTable, stack

H = "transformer.h.$L"


def dims(cfg: Any) -> dict[str, int]:
    """The size of each dimension symbol of the rows below."""
    return {"V": cfg.vocab_size, "P": cfg.n_positions, "E": cfg.n_embd, "I": cfg.n_inner, "L": cfg.n_layer,
            "EH": cfg.n_embd}


def groups(cfg: Any) -> dict[str, Groups]:
    """EH, the attention's width, is made of the heads (`models.table`)."""
    return {"EH": Groups("heads", cfg.n_head)}


def layer_norm(path: str, hf: str) -> tuple[Param, Param]:
    """A LayerNorm's `scale` (init 1) and `bias` (init 0), `[E]` each (axes None)."""
    return (
        Param(f"{path}.scale", ("E",), (None,), f"{hf}.weight", init="ones"),
        Param(f"{path}.bias", ("E",), (None,), f"{hf}.bias", init="zeros"),
    )


LAYER = (
    *layer_norm("ln_1", f"{H}.ln_1"),
    Param("qkv.kernel", ("E", 3, "EH"), ("embed", None, "heads"), f"{H}.attn.c_attn.weight", "unflatten(1, 3, -1)"),
    Param("qkv.bias", (3, "EH"), (None, "heads"), f"{H}.attn.c_attn.bias", "unflatten(0, 3, -1)", init="zeros"),
    Param("attn_out.kernel", ("EH", "E"), ("heads", "embed"), f"{H}.attn.c_proj.weight"),
    Param("attn_out.bias", ("E",), (None,), f"{H}.attn.c_proj.bias", init="zeros"),
    *layer_norm("ln_2", f"{H}.ln_2"),
    Param("fc.kernel", ("E", "I"), ("embed", "mlp"), f"{H}.mlp.c_fc.weight"),
    Param("fc.bias", ("I",), ("mlp",), f"{H}.mlp.c_fc.bias", init="zeros"),
    Param("proj.kernel", ("I", "E"), ("mlp", "embed"), f"{H}.mlp.c_proj.weight"),
    Param("proj.bias", ("E",), (None,), f"{H}.mlp.c_proj.bias", init="zeros"),
)

# GPT-2's nn.LayerNorm params (the HF Trainer does not decay them: `ln_1` matches no name pattern)
LAYERNORMS = tuple(f"{hf}.{p}" for hf in ("transformer.h.$.ln_1", "transformer.h.$.ln_2", "transformer.ln_f")
                   for p in ("weight", "bias"))

TABLE = ParamTable(
    __name__,
    dims,
    (
        Param("wte.embedding", ("V", "E"), ("vocab", "embed"), "transformer.wte.weight"),
        Param("wpe.embedding", ("P", "E"), (None, "embed"), "transformer.wpe.weight"),
        *stack("layers", LAYER),
        *layer_norm("ln_f", "transformer.ln_f"),
        # the tied head duplicates wte; causal-mask buffers of older files
        Drop("lm_head.weight"),
        Drop(f"{H}.attn.bias"),
        Drop(f"{H}.attn.masked_bias"),
    ),
    groups,
    layernorms=LAYERNORMS,
)
