"""The Llama 4 text family's params (`models.table`), HF Llama4ForCausalLM names as transformers
5.24 `save_pretrained` writes them (and the releases hold them):

  embed, layers.{attn_norm, q, k, v, o, mlp_norm}, final_norm, lm_head   Llama's rows
  moe.router.kernel                [Lm, E, X]        feed_forward.router.weight [X, E], transposed
  moe.experts.gate_up.kernel       [Lm, X, E, 2, M]  feed_forward.experts.gate_up_proj [X, E, 2 M]
                                                     (already [in, out]): the 2 M columns
                                                     unflattened to [2, M], row 0 gate, row 1 up,
                                                     so tp shards the width of each
  moe.experts.down.kernel          [Lm, X, M, E]     feed_forward.experts.down_proj [X, M, E], as is
  moe.shared.{gate,up,down}.kernel [Lm, E, M] ...    feed_forward.shared_expert.*_proj.weight
  mlp.{gate,up,down}.kernel        [Ld, E, MD] ...   feed_forward.{gate,up,down}_proj.weight (dense)

The MoE rows stack the layers of `{moe_layers}`, the dense ones those of `{dense_layers}`
(`models.moe`). Dimensions: Llama's (M = `intermediate_size`, the experts' and shared expert's
width) plus X experts, MD the dense layers' width, Lm / Ld the MoE / dense layer counts. The
experts axis maps to the mesh's experts rule (dp by default), the heads to tp on head
boundaries (`Groups`). The export is the rules' inverse: the fused tensors come back bitwise.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.llama import params as llama
from hybridckpt.models.mlp_table import swiglu
from hybridckpt.models.table import Groups, Param, ParamTable, stack, under, when

FF = f"{llama.LAYER}.feed_forward"


def dims(cfg: Any) -> dict[str, int]:
    """Llama's dimension symbols plus the MoE and dense groups'."""
    return llama.dims(cfg) | {
        "X": cfg.num_experts,
        "MD": cfg.intermediate_size_mlp,
        "Lm": len(cfg.moe_layers),
        "Ld": len(cfg.dense_layers),
    }


def groups(cfg: Any) -> dict[str, Groups]:
    """Llama's head dimensions plus X, the experts."""
    return llama.groups(cfg) | {"X": Groups("experts", cfg.num_experts)}


ATTENTION = (llama.ATTN_NORM, *llama.ATTENTION, llama.MLP_NORM)
MOE = (
    Param("router.kernel", ("E", "X"), ("embed", None), f"{FF}.router.weight", "transpose"),
    Param("experts.gate_up.kernel", ("X", "E", 2, "M"), ("experts", "embed", None, "mlp"),
          f"{FF}.experts.gate_up_proj", "unflatten(2, 2, -1)"),  # fmt: skip
    Param("experts.down.kernel", ("X", "M", "E"), ("experts", "mlp", "embed"), f"{FF}.experts.down_proj"),
    *under("shared", swiglu(f"{FF}.shared_expert", "M")),
)

ROWS = (
    llama.EMBED,
    *stack("layers", ATTENTION),
    *when("has_moe_layers", stack("moe", MOE, dim="Lm", index="$L in {moe_layers}")),
    *when("has_dense_layers", stack("mlp", swiglu(FF, "MD"), dim="Ld", index="$L in {dense_layers}")),
    llama.FINAL_NORM,
    llama.LM_HEAD,
    llama.TIED_HEAD,
)

# transformers 5.24 Llama4TextDecoderLayer: self_attn (q, k, v, o; the L2 qk-norm has no params),
# feed_forward (a dense layer's gate/up/down; a sparse layer's experts, as stored fused, its router,
# its shared expert), then the norms: NOT the rows' order (norms first)
NAMED_PARAMETERS = llama.hf_order((
    *llama.ATTENTION_ORDER,
    *(n.replace("mlp.", "feed_forward.") for n in llama.MLP_ORDER),
    "feed_forward.experts.gate_up_proj",
    "feed_forward.experts.down_proj",
    "feed_forward.router.weight",
    *(n.replace("mlp.", "feed_forward.shared_expert.") for n in llama.MLP_ORDER),
    *llama.NORMS_ORDER,
))

TABLE = ParamTable(__name__, dims, ROWS, groups, named_parameters=NAMED_PARAMETERS)
