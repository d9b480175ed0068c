"""The DeepSeek V3.2 family's params (`models.table`): DeepSeek V3's table
(`models.deepseek_v3.params.table`: `layers`, `mlp`, `moe`, `mtp` groups) whose decoder layers,
the MTP modules' too, add the lightning indexer under `indexer`:

| param | shape | axes | HF (`model.layers.{i}.self_attn.indexer.`) |
|---|---|---|---|
| `wq_b.kernel` | `[QL, IQ]` | `(None, heads)` | `wq_b.weight` `[IQ, QL]`, transposed |
| `wk.kernel` | `[E, ID]` | `(embed, None)` | `wk.weight` `[ID, E]`, transposed |
| `k_norm.scale`, `k_norm.bias` | `[ID]` | `(None,)` | `k_norm.weight`, `k_norm.bias` (a LayerNorm) |
| `weights_proj.kernel` | `[E, IH]` | `(embed, None)` | `weights_proj.weight` `[IH, E]`, transposed |

IH = index_n_heads, ID = index_head_dim, IQ = IH * ID (made of the IH index heads: split over tp
on head boundaries, as MLA's q_b); the single index key `wk` and the per-head weights (a small
`[E, IH]`) are replicated over tp. Each tensor keeps its stored dtype through import and export
(transformers keeps `weights_proj` fp32 in a bf16 model, `_keep_in_fp32_modules`).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.deepseek_v3 import params as v3
from hybridckpt.models.llama.params import hf_order
from hybridckpt.models.table import Groups, Param


def dims(cfg: Any) -> dict[str, int]:
    """The indexer's dimension symbols."""
    IH, ID = cfg.index_n_heads, cfg.index_head_dim
    return {"IH": IH, "ID": ID, "IQ": IH * ID}


def groups(cfg: Any) -> dict[str, Groups]:
    """IQ is made of the index heads."""
    return {"IQ": Groups("heads", cfg.index_n_heads)}


def decoder(i: str) -> tuple[Param, ...]:
    """One decoder layer: DeepSeek V3's norms and MLA, then the indexer (HF layer index `i`)."""
    at = f"model.layers.{i}.self_attn.indexer"
    return (
        *v3.decoder(i),
        Param("indexer.wq_b.kernel", ("QL", "IQ"), (None, "heads"), f"{at}.wq_b.weight", "transpose"),
        Param("indexer.wk.kernel", ("E", "ID"), ("embed", None), f"{at}.wk.weight", "transpose"),
        Param("indexer.k_norm.scale", ("ID",), (None,), f"{at}.k_norm.weight", init="ones"),
        Param("indexer.k_norm.bias", ("ID",), (None,), f"{at}.k_norm.bias", init="zeros"),
        Param("indexer.weights_proj.kernel", ("E", "IH"), ("embed", None), f"{at}.weights_proj.weight", "transpose"),
    )  # fmt: skip


# transformers 5.24 DeepseekV32DecoderLayer's named_parameters(): the attention (q LoRA always),
# its indexer, then the MLP and norms as DeepSeek V3's
NAMED_PARAMETERS = hf_order(
    (
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_proj.bias",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_proj_with_mqa.bias",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.o_proj.bias",
        "self_attn.indexer.wq_b.weight",
        "self_attn.indexer.wk.weight",
        "self_attn.indexer.k_norm.weight",
        "self_attn.indexer.k_norm.bias",
        "self_attn.indexer.weights_proj.weight",
        *v3.MLP_AND_NORMS_ORDER,
    )
)

# the indexer's k_norm is an nn.LayerNorm: the HF Trainer keeps it out of weight decay
LAYERNORMS = tuple(f"model.layers.$.self_attn.indexer.k_norm.{p}" for p in ("weight", "bias"))

TABLE = v3.table(__name__, decoder, dims, groups, NAMED_PARAMETERS, LAYERNORMS)
