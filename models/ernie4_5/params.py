"""The ERNIE 4.5 dense family's params (`models.table`): Llama's rows (`models.llama.params`) plus,
with `use_bias`, the biases of q, k, v, o (`models.qwen2.params`'s rows: q `[Q]` split with its
heads, k / v with the kv heads, o `[E]` replicated) and of the MLP (`mlp_biases`: gate / up `[M]`
on the `mlp` axis, down `[E]` replicated), HF Ernie4_5ForCausalLM names.
"""

from __future__ import annotations

from hybridckpt.models.llama.params import (
    ATTENTION,
    ATTENTION_ORDER,
    ATTN_NORM,
    LAYER,
    MLP,
    MLP_NORM,
    MLP_ORDER,
    NORMS_ORDER,
    decoder_table,
    hf_order,
)
from hybridckpt.models.qwen2.params import K_BIAS, O_BIAS, Q_BIAS, V_BIAS
from hybridckpt.models.table import Param, when

ATTENTION_BIASES = when("use_bias", (Q_BIAS, K_BIAS, V_BIAS, O_BIAS))


def mlp_biases(hf: str, width: str) -> tuple[Param, ...]:
    """A SwiGLU's biases, existing with `use_bias`: `{gate,up}.bias [width]` (axis mlp) and
    `down.bias [E]` from HF `{hf}.{gate,up,down}_proj.bias`."""
    return when("use_bias", (
        Param("gate.bias", (width,), ("mlp",), f"{hf}.gate_proj.bias", init="zeros"),
        Param("up.bias", (width,), ("mlp",), f"{hf}.up_proj.bias", init="zeros"),
        Param("down.bias", ("E",), (None,), f"{hf}.down_proj.bias", init="zeros"),
    ))  # fmt: skip


def with_biases(names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` (`*.weight`), each followed by its `*.bias`: a Linear's `weight` then `bias`."""
    return tuple(x for n in names for x in (n, n.removesuffix("weight") + "bias"))


# transformers 5.24 Ernie4_5DecoderLayer: self_attn (q, k, v, o, each weight then bias), mlp
# (gate, up, down, likewise), then the norms: NOT the rows' order (norms first)
LAYER_ORDER = (*with_biases(ATTENTION_ORDER), *with_biases(MLP_ORDER), *NORMS_ORDER)

TABLE = decoder_table(__name__, (ATTN_NORM, *ATTENTION, *ATTENTION_BIASES, MLP_NORM, *MLP, *mlp_biases(f"{LAYER}.mlp", "M")), hf_order(LAYER_ORDER))
