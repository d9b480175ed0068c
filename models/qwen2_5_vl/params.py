"""The Qwen2.5-VL wrapper's params (`models.table`):
- the text model: Qwen2's rows (`models.qwen2.params`: q/k/v biases), HF names under the
  checkpoint's text prefix `{text}` (`models.qwen3_vl.params.text_row`), head `lm_head.weight`;
- the vision tower `vision.*` (`Qwen2_5_VisionTransformerPretrainedModel`): every tensor as
  stored (HF layout, carried bit for bit, never run), replicated; blocks stacked on `[VL]`
  with no mesh axis; RMSNorm weights `norm1`, `norm2`, `ln_q` (no biases), SwiGLU MLP with
  biases, the merger's `mlp.0` / `mlp.2`. Names under `{vision}`.
Dimensions: Qwen2's, plus the tower's (`models.qwen3_vl.params`: VE, VI, VL, C, TP, P, VM, VO,
E3).
"""

from __future__ import annotations

from typing import Any

from hybridckpt.models.qwen2.params import TABLE as TEXT
from hybridckpt.models.qwen3_vl.params import carried, linear, named_parameters, text_row
from hybridckpt.models.table import ParamTable, stack, under


def dims(cfg: Any) -> dict[str, int]:
    """Qwen2's dimension symbols plus the tower's."""
    ve = cfg.vision_hidden_size
    return TEXT.dims(cfg) | {"VE": ve, "VI": cfg.vision_intermediate_size, "VL": cfg.vision_depth,
                             "C": cfg.vision_in_channels, "TP": cfg.vision_temporal_patch_size,
                             "P": cfg.vision_patch_size, "VM": cfg.vision_merged_size,
                             "VO": cfg.vision_out_hidden_size, "E3": 3 * ve}  # fmt: skip


V = "{vision}"
_BLOCK = (
    carried("norm1.weight", ("VE",), f"{V}blocks.$V.norm1.weight", "ones"),
    carried("norm2.weight", ("VE",), f"{V}blocks.$V.norm2.weight", "ones"),
    *linear("qkv", f"{V}blocks.$V.attn.qkv", "E3", "VE"),
    *linear("proj", f"{V}blocks.$V.attn.proj", "VE", "VE"),
    *linear("gate", f"{V}blocks.$V.mlp.gate_proj", "VI", "VE"),
    *linear("up", f"{V}blocks.$V.mlp.up_proj", "VI", "VE"),
    *linear("down", f"{V}blocks.$V.mlp.down_proj", "VE", "VI"),
)
VISION = (
    carried("patch.weight", ("VE", "C", "TP", "P", "P"), f"{V}patch_embed.proj.weight"),
    *stack("blocks", _BLOCK, dim="VL", axis=None, index="$V"),
    carried("merger.norm.weight", ("VE",), f"{V}merger.ln_q.weight", "ones"),
    *under("merger", linear("fc1", f"{V}merger.mlp.0", "VM", "VM")),
    *under("merger", linear("fc2", f"{V}merger.mlp.2", "VO", "VM")),
)

TABLE = ParamTable(
    __name__,
    dims,
    (
        *(text_row(r) for r in TEXT.rows),
        *under("vision", VISION),
    ),
    TEXT.groups,
    # (the tower's norms are RMSNorms: no nn.LayerNorm, no `layernorms`)
    named_parameters=named_parameters(TEXT, VISION),
)
