"""The Mistral 3 wrapper's params (`models.table`):
- the text model: Llama's rows (`models.llama.params`, Mistral's table: the same paths, shapes
  and axes, so the Mistral module runs on them), their HF names under the checkpoint's text
  prefix `{text}` (`model.` of MistralForCausalLM replaced) and the head `{head}`;
- the Pixtral vision tower `vision.*` and the projector `projector.*`, each tensor as stored (HF
  layout, no op: carried bit for bit, never run), axes None (replicated), the tower's layers
  stacked on a leading `[VL]` axis with no mesh axis. Names under `{vision}` and `{projector}`
  (`models.mistral3.config`). Pixtral has no biases; the projector's two Linears have them only
  with `multimodal_projector_bias`.
Dimensions: Llama's, plus VE the tower's width, VI its MLP width, VL its layers, C image
channels, P the patch side, VM = VE * spatial_merge_size ** 2 (the patch merger's input), VF =
VE * the number of vision feature layers (linear_1's input).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models.llama.params import TABLE as TEXT
from hybridckpt.models.table import Drop, Param, ParamTable, stack, under, when


def dims(cfg: Any) -> dict[str, int]:
    """Llama's dimension symbols plus the tower's and the projector's."""
    ve = cfg.vision_hidden_size
    return TEXT.dims(cfg) | {"VE": ve, "VI": cfg.vision_intermediate_size, "VL": cfg.vision_num_layers,
                             "C": cfg.vision_num_channels, "P": cfg.vision_patch_size,
                             "VM": ve * cfg.spatial_merge_size**2, "VF": ve * cfg.num_feature_layers}  # fmt: skip


def _text(row):
    """A Llama text row with its HF name under the wrapper's prefixes."""
    if row.hf == "lm_head.weight":
        return replace(row, hf="{head}")
    assert row.hf.startswith("model."), row.hf
    return replace(row, hf="{text}" + row.hf.removeprefix("model."))


def _carried(path: str, shape: tuple, hf: str, init: str = "normal") -> Param:
    return Param(path, shape, (None,) * len(shape), hf, init=init)


V = "{vision}transformer.layers.$V"
_LAYER = (
    _carried("attention_norm.weight", ("VE",), f"{V}.attention_norm.weight", "ones"),
    *(
        _carried(f"{p}.weight", ("VE", "VE"), f"{V}.attention.{p}.weight")
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ),
    _carried("ffn_norm.weight", ("VE",), f"{V}.ffn_norm.weight", "ones"),
    _carried("gate_proj.weight", ("VI", "VE"), f"{V}.feed_forward.gate_proj.weight"),
    _carried("up_proj.weight", ("VI", "VE"), f"{V}.feed_forward.up_proj.weight"),
    _carried("down_proj.weight", ("VE", "VI"), f"{V}.feed_forward.down_proj.weight"),
)
VISION = (
    _carried("patch_conv.weight", ("VE", "C", "P", "P"), "{vision}patch_conv.weight"),
    _carried("ln_pre.weight", ("VE",), "{vision}ln_pre.weight", "ones"),
    *stack("layers", _LAYER, dim="VL", axis=None, index="$V"),
)
PR = "{projector}"
PROJECTOR = (
    _carried("norm.weight", ("VE",), f"{PR}norm.weight", "ones"),
    _carried("merging_layer.weight", ("VE", "VM"), f"{PR}patch_merger.merging_layer.weight"),
    _carried("linear_1.weight", ("E", "VF"), f"{PR}linear_1.weight"),
    *when("projector_bias", (_carried("linear_1.bias", ("E",), f"{PR}linear_1.bias", "zeros"),)),
    _carried("linear_2.weight", ("E", "E"), f"{PR}linear_2.weight"),
    *when("projector_bias", (_carried("linear_2.bias", ("E",), f"{PR}linear_2.bias", "zeros"),)),
)


def _named_parameters() -> tuple[str, ...]:
    """transformers 5.24 Mistral3ForConditionalGeneration's `named_parameters()` order
    (`ParamTable.named_parameters`): the Pixtral tower (each layer's attention_norm, feed_forward,
    attention defining k, v, q, o, ffn_norm), the projector (norm, patch merger, linear_1,
    linear_2, each weight then bias), the text model (Llama's order), the head; written with the
    checkpoint's prefixes, so the Hub's names (`language_model.model.*`) and the module's
    (`model.language_model.*`) sort alike."""
    layer = (
        "attention_norm.weight",
        *(f"feed_forward.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"attention.{p}_proj.weight" for p in "kvqo"),
        "ffn_norm.weight",
    )
    vision = ("{vision}patch_conv.weight", "{vision}ln_pre.weight", *(f"{V}.{n}".replace("$V", "$") for n in layer))
    projector = (f"{PR}norm.weight", f"{PR}patch_merger.merging_layer.weight",
                 *(f"{PR}linear_{i}.{w}" for i in (1, 2) for w in ("weight", "bias")))  # fmt: skip
    text = tuple("{head}" if n == "lm_head.weight" else "{text}" + n.removeprefix("model.") for n in TEXT.hf_order())
    return (*vision, *projector, *text)


TABLE = ParamTable(
    __name__,
    dims,
    (
        *(
            r if isinstance(r, Drop) and not r.hf.startswith(("model.", "lm_head")) else _text(r)
            for r in TEXT.rows
        ),
        *under("vision", VISION),
        *under("projector", PROJECTOR),
    ),
    TEXT.groups,
    named_parameters=_named_parameters(),
)
