"""The Llama 4 multimodal wrapper's params (`models.table`):
- the text model: Llama 4's rows (`models.llama4.params`: the same paths, shapes and axes, so the
  Llama 4 module runs on them), their HF names under `language_model.` (`language_model.model.*`,
  `language_model.lm_head.weight`);
- the vision tower `vision.*` (`vision_model.*`) and the projector `projector.*`
  (`multi_modal_projector.*`), each tensor as stored (HF layout, no op: carried bit for bit,
  never run), axes None (replicated), the tower's encoder layers stacked on a leading `[VL]` axis
  with no mesh axis.
Dimensions: Llama 4's, plus VE the tower's width, VI its MLP width, VL its layers, CPP the
unfolded patch (channels * patch * patch), NP the position rows (patches + class token), PI / PO
the pixel-shuffle adapter's widths, VO the tower's output width.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models.llama4.params import TABLE as TEXT
from hybridckpt.models.table import Param, ParamTable, stack, under


def dims(cfg: Any) -> dict[str, int]:
    """Llama 4's dimension symbols plus the tower's."""
    p = cfg.vision_patch_size
    return TEXT.dims(cfg) | {"VE": cfg.vision_hidden_size, "VI": cfg.vision_intermediate_size,
                             "VL": cfg.vision_num_layers, "CPP": cfg.vision_num_channels * p * p,
                             "NP": cfg.vision_positions, "PI": cfg.projector_input_dim,
                             "PO": cfg.projector_output_dim, "VO": cfg.vision_output_dim}  # fmt: skip


def _carried(path: str, shape: tuple, hf: str, init: str = "normal") -> Param:
    return Param(path, shape, (None,) * len(shape), hf, init=init)


def _linear(path: str, hf: str, out: str, inp: str) -> tuple[Param, Param]:
    return (_carried(f"{path}.weight", (out, inp), f"{hf}.weight"),
            _carried(f"{path}.bias", (out,), f"{hf}.bias", "zeros"))  # fmt: skip


def _layer_norm(path: str, hf: str) -> tuple[Param, Param]:
    return (_carried(f"{path}.weight", ("VE",), f"{hf}.weight", "ones"),
            _carried(f"{path}.bias", ("VE",), f"{hf}.bias", "zeros"))  # fmt: skip


V = "vision_model"
L = f"{V}.model.layers.$V"
_ENCODER_LAYER = (
    *_layer_norm("input_layernorm", f"{L}.input_layernorm"),
    *_linear("q_proj", f"{L}.self_attn.q_proj", "VE", "VE"),
    *_linear("k_proj", f"{L}.self_attn.k_proj", "VE", "VE"),
    *_linear("v_proj", f"{L}.self_attn.v_proj", "VE", "VE"),
    *_linear("o_proj", f"{L}.self_attn.o_proj", "VE", "VE"),
    *_layer_norm("post_attention_layernorm", f"{L}.post_attention_layernorm"),
    *_linear("fc1", f"{L}.mlp.fc1", "VI", "VE"),
    *_linear("fc2", f"{L}.mlp.fc2", "VE", "VI"),
)
VISION = (
    _carried("patch.weight", ("VE", "CPP"), f"{V}.patch_embedding.linear.weight"),
    _carried("class_embedding", ("VE",), f"{V}.class_embedding"),
    _carried("position", ("NP", "VE"), f"{V}.positional_embedding_vlm"),
    *_layer_norm("layernorm_pre", f"{V}.layernorm_pre"),
    *stack("encoder", _ENCODER_LAYER, dim="VL", axis=None, index="$V"),
    *_layer_norm("layernorm_post", f"{V}.layernorm_post"),
    _carried("adapter.fc1.weight", ("PI", "VI"), f"{V}.vision_adapter.mlp.fc1.weight"),
    _carried("adapter.fc2.weight", ("PO", "PO"), f"{V}.vision_adapter.mlp.fc2.weight"),
)
PROJECTOR = (_carried("linear.weight", ("E", "VO"), "multi_modal_projector.linear_1.weight"),)


def _named_parameters() -> tuple[str, ...]:
    """transformers 5.24 Llama4ForConditionalGeneration's `named_parameters()` order
    (`ParamTable.named_parameters`): the vision tower (class and position embeddings, the patch
    embedding, the outer norms, each encoder layer's attention and MLP then its norms, the
    adapter; each Linear's weight then bias), the projector, the text model (Llama 4's order)."""
    layer = (*(f"self_attn.{p}_proj.{w}" for p in "qkvo" for w in ("weight", "bias")),
             *(f"mlp.fc{i}.{w}" for i in (1, 2) for w in ("weight", "bias")),
             *(f"{n}.{w}" for n in ("input_layernorm", "post_attention_layernorm") for w in ("weight", "bias")))  # fmt: skip
    vision = (
        f"{V}.class_embedding", f"{V}.positional_embedding_vlm", f"{V}.patch_embedding.linear.weight",
        *(f"{V}.layernorm_{n}.{w}" for n in ("pre", "post") for w in ("weight", "bias")),
        *(f"{V}.model.layers.$.{n}" for n in layer),
        f"{V}.vision_adapter.mlp.fc1.weight", f"{V}.vision_adapter.mlp.fc2.weight",
    )  # fmt: skip
    return (*vision, "multi_modal_projector.linear_1.weight", *("language_model." + n for n in TEXT.hf_order()))


# the vision tower's `nn.LayerNorm` params (the Trainer keeps them out of weight decay)
LAYERNORMS = tuple(
    f"{V}.{n}.{w}"
    for n in ("layernorm_pre", "layernorm_post", "model.layers.$.input_layernorm", "model.layers.$.post_attention_layernorm")
    for w in ("weight", "bias")
)

TABLE = ParamTable(
    __name__,
    dims,
    (
        *(replace(r, hf="language_model." + r.hf) for r in TEXT.rows),
        *under("vision", VISION),
        *under("projector", PROJECTOR),
    ),
    TEXT.groups,
    named_parameters=_named_parameters(),
    layernorms=LAYERNORMS,
)
