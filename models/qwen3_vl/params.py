"""The Qwen3-VL wrapper's params (`models.table`):
- the text model: Qwen3's rows (`models.qwen3.params`: the same paths, shapes and axes, so the
  Qwen3 block runs on them; heads over tp on head boundaries by its groups), their HF names
  under the checkpoint's text prefix `{text}` (`model.` of Qwen3ForCausalLM replaced); the head
  `lm_head.weight` as Qwen3's;
- the vision tower `vision.*` (`Qwen3VLVisionModel`): every tensor as stored (HF layout, no op:
  carried bit for bit, never run), axes None (replicated); its blocks stacked on a leading
  `[VL]` axis and its DeepStack mergers on `[ND]`, neither on a mesh axis. Names under
  `{vision}`.
Dimensions: Qwen3's, plus VE the tower's width, VI its MLP width, VL its blocks, C channels,
TP the temporal patch, P the patch side, NPOS the position table's rows, VM = VE * merge ** 2
the merger's width, VO its output (the text width), ND the DeepStack mergers, E3 = 3 VE.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models.qwen3.params import TABLE as TEXT
from hybridckpt.models.table import Param, ParamTable, Row, stack, under


def dims(cfg: Any) -> dict[str, int]:
    """Qwen3's dimension symbols plus the tower's."""
    ve = cfg.vision_hidden_size
    return TEXT.dims(cfg) | {"VE": ve, "VI": cfg.vision_intermediate_size, "VL": cfg.vision_depth,
                             "C": cfg.vision_in_channels, "TP": cfg.vision_temporal_patch_size,
                             "P": cfg.vision_patch_size, "NPOS": cfg.vision_num_position_embeddings,
                             "VM": cfg.vision_merged_size, "VO": cfg.vision_out_hidden_size,
                             "ND": len(cfg.vision_deepstack_layers), "E3": 3 * ve}  # fmt: skip


def text_row(row: Row) -> Row:
    """A text family's row with its HF name under the wrapper's text prefix `{text}`."""
    if not row.hf.startswith("model."):
        return row  # the head (`lm_head.weight`) is named alike
    return replace(row, hf="{text}" + row.hf.removeprefix("model."))


def carried(path: str, shape: tuple, hf: str, init: str = "normal") -> Param:
    """A tower tensor carried as stored: HF layout, replicated."""
    return Param(path, shape, (None,) * len(shape), hf, init=init)


def linear(path: str, hf: str, out: str, inp: str, bias: bool = True) -> tuple[Param, ...]:
    """A torch Linear's weight `[out, in]` (and bias `[out]`) as stored."""
    weight = carried(f"{path}.weight", (out, inp), f"{hf}.weight")
    return (weight, carried(f"{path}.bias", (out,), f"{hf}.bias", "zeros")) if bias else (weight,)


def layer_norm(path: str, hf: str, dim: str = "VE") -> tuple[Param, Param]:
    return (carried(f"{path}.weight", (dim,), f"{hf}.weight", "ones"),
            carried(f"{path}.bias", (dim,), f"{hf}.bias", "zeros"))  # fmt: skip


V = "{vision}"
_BLOCK = (
    *layer_norm("norm1", f"{V}blocks.$V.norm1"),
    *layer_norm("norm2", f"{V}blocks.$V.norm2"),
    *linear("qkv", f"{V}blocks.$V.attn.qkv", "E3", "VE"),
    *linear("proj", f"{V}blocks.$V.attn.proj", "VE", "VE"),
    *linear("fc1", f"{V}blocks.$V.mlp.linear_fc1", "VI", "VE"),
    *linear("fc2", f"{V}blocks.$V.mlp.linear_fc2", "VE", "VI"),
)


def _merger(hf: str, norm_dim: str) -> tuple[Param, ...]:
    """`Qwen3VLVisionPatchMerger`: LayerNorm (over VE, or VM after the shuffle), fc1, fc2."""
    return (*layer_norm("norm", f"{hf}.norm", norm_dim),
            *linear("fc1", f"{hf}.linear_fc1", "VM", "VM"),
            *linear("fc2", f"{hf}.linear_fc2", "VO", "VM"))  # fmt: skip


VISION = (
    carried("patch.weight", ("VE", "C", "TP", "P", "P"), f"{V}patch_embed.proj.weight"),
    carried("patch.bias", ("VE",), f"{V}patch_embed.proj.bias", "zeros"),
    carried("position.weight", ("NPOS", "VE"), f"{V}pos_embed.weight"),
    *stack("blocks", _BLOCK, dim="VL", axis=None, index="$V"),
    *under("merger", _merger(f"{V}merger", "VE")),
    *stack(
        "deepstack", _merger(f"{V}deepstack_merger_list.$D", "VM"), dim="ND", axis=None, index="$D"
    ),
)


def named_parameters(text: ParamTable, vision: tuple[Row, ...]) -> tuple[str, ...]:
    """transformers 5's `named_parameters()` order of a Qwen-VL wrapper (`ParamTable.
    named_parameters`): its model defines the tower `visual` before the `language_model`, so the
    tower comes first, in the order of its `vision` rows (written in its modules' definition
    order), then the `text` family's order under `{text}`, then the head. The Trainer optimizes
    the tower too (it is no buffer), so an index-keyed state counts its params first. A number in
    a tower name (a Sequential's `merger.mlp.0`) is written `$`, as every number of the order is."""
    tower = tuple(
        ".".join("$" if c.isdigit() else c for c in n.split("."))
        for n in ParamTable(__name__, dims, vision).hf_order()
    )
    model = "model."
    return (*tower, *("{text}" + n.removeprefix(model) if n.startswith(model) else n for n in text.hf_order()))


# the tower's nn.LayerNorm params (the HF Trainer keeps them out of weight decay whatever their names:
# `norm1` is none its name patterns know)
LAYERNORMS = tuple(
    f"{V}{m}.{p}"
    for m in ("blocks.$.norm1", "blocks.$.norm2", "merger.norm", "deepstack_merger_list.$.norm")
    for p in ("weight", "bias")
)

TABLE = ParamTable(
    __name__,
    dims,
    (
        *(text_row(r) for r in TEXT.rows),
        *under("vision", VISION),
    ),
    TEXT.groups,
    named_parameters=named_parameters(TEXT, VISION),
    layernorms=LAYERNORMS,
)
