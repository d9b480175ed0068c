"""The Gemma 3 multimodal wrapper's params (`models.table`):
- the text model: Gemma 3's rows (`models.gemma3.params`: the same paths, shapes and axes, so
  the Gemma 3 module runs on them), their HF names under the checkpoint's text prefix `{text}`
  (`model.` of Gemma3ForCausalLM replaced) and the head `{head}`;
- the SigLIP vision tower `vision.*` and the projector `projector.*`, each tensor as stored
  (HF layout, no op: carried bit for bit, never run), axes None (replicated), the tower's
  encoder layers stacked on a leading `[VL]` axis with no mesh axis. Names under `{vision}`
  and `{projector}` (`models.gemma3_mm.config`).
Dimensions: Gemma 3's, plus VE the tower's width, VI its MLP width, VL its layers, C image
channels, P the patch side, NP the patches per image, E3 = 3 VE (the pooling head's fused
in-projection).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hybridckpt.models.gemma3.params import TABLE as TEXT
from hybridckpt.models.table import Drop, Param, ParamTable, stack, under, when


def dims(cfg: Any) -> dict[str, int]:
    """Gemma 3's dimension symbols plus the tower's."""
    ve = cfg.vision_hidden_size
    return TEXT.dims(cfg) | {"VE": ve, "VI": cfg.vision_intermediate_size, "VL": cfg.vision_num_layers,
                             "C": cfg.vision_num_channels, "P": cfg.vision_patch_size,
                             "NP": cfg.vision_positions, "E3": 3 * ve}  # fmt: skip


def _text(row):
    """A Gemma 3 text row with its HF name under the wrapper's prefixes."""
    if row.hf == "lm_head.weight":
        return replace(row, hf="{head}")
    assert row.hf.startswith("model."), row.hf
    return replace(row, hf="{text}" + row.hf.removeprefix("model."))


def _carried(path: str, shape: tuple, hf: str, init: str = "normal") -> Param:
    return Param(path, shape, (None,) * len(shape), hf, init=init)


def _linear(path: str, hf: str, out: str, inp: str) -> tuple[Param, Param]:
    return (_carried(f"{path}.weight", (out, inp), f"{hf}.weight"),
            _carried(f"{path}.bias", (out,), f"{hf}.bias", "zeros"))  # fmt: skip


def _layer_norm(path: str, hf: str) -> tuple[Param, Param]:
    return (_carried(f"{path}.weight", ("VE",), f"{hf}.weight", "ones"),
            _carried(f"{path}.bias", ("VE",), f"{hf}.bias", "zeros"))  # fmt: skip


V = "{vision}"
_ENCODER_LAYER = (
    *_layer_norm("layer_norm1", f"{V}encoder.layers.$V.layer_norm1"),
    *_linear("q_proj", f"{V}encoder.layers.$V.self_attn.q_proj", "VE", "VE"),
    *_linear("k_proj", f"{V}encoder.layers.$V.self_attn.k_proj", "VE", "VE"),
    *_linear("v_proj", f"{V}encoder.layers.$V.self_attn.v_proj", "VE", "VE"),
    *_linear("out_proj", f"{V}encoder.layers.$V.self_attn.out_proj", "VE", "VE"),
    *_layer_norm("layer_norm2", f"{V}encoder.layers.$V.layer_norm2"),
    *_linear("fc1", f"{V}encoder.layers.$V.mlp.fc1", "VI", "VE"),
    *_linear("fc2", f"{V}encoder.layers.$V.mlp.fc2", "VE", "VI"),
)
# the attention-pooling head (`vision_use_head`; Gemma 3's releases have none)
_POOL_HEAD = (
    _carried("probe", (1, 1, "VE"), f"{V}head.probe"),
    _carried("in_proj.weight", ("E3", "VE"), f"{V}head.attention.in_proj_weight"),
    _carried("in_proj.bias", ("E3",), f"{V}head.attention.in_proj_bias", "zeros"),
    *_linear("out_proj", f"{V}head.attention.out_proj", "VE", "VE"),
    *_layer_norm("layernorm", f"{V}head.layernorm"),
    *_linear("fc1", f"{V}head.mlp.fc1", "VI", "VE"),
    *_linear("fc2", f"{V}head.mlp.fc2", "VE", "VI"),
)
VISION = (
    _carried("patch.weight", ("VE", "C", "P", "P"), f"{V}embeddings.patch_embedding.weight"),
    _carried("patch.bias", ("VE",), f"{V}embeddings.patch_embedding.bias", "zeros"),
    _carried("position.weight", ("NP", "VE"), f"{V}embeddings.position_embedding.weight"),
    *stack("encoder", _ENCODER_LAYER, dim="VL", axis=None, index="$V"),
    *_layer_norm("post_layernorm", f"{V}post_layernorm"),
    *when("vision_head", under("head", _POOL_HEAD)),
)
PROJECTOR = (
    _carried("input.weight", ("VE", "E"), "{projector}mm_input_projection_weight"),
    _carried("norm.weight", ("VE",), "{projector}mm_soft_emb_norm.weight", "zeros"),
)


def _named_parameters() -> tuple[str, ...]:
    """transformers 5 Gemma3ForConditionalGeneration's `named_parameters()` order (`ParamTable.
    named_parameters`): the SigLIP tower (its attention defines k, v, q, out), the projector, the
    text model (Gemma 3's order under `{text}`), the head `{head}`."""
    def lin(hf: str) -> tuple[str, str]:
        return f"{hf}.weight", f"{hf}.bias"

    layer = f"{V}encoder.layers.$."
    vision = (
        *lin(f"{V}embeddings.patch_embedding"), f"{V}embeddings.position_embedding.weight",
        *lin(f"{layer}layer_norm1"), *(n for p in "kvq" for n in lin(f"{layer}self_attn.{p}_proj")),
        *lin(f"{layer}self_attn.out_proj"), *lin(f"{layer}layer_norm2"), *lin(f"{layer}mlp.fc1"), *lin(f"{layer}mlp.fc2"),
        *lin(f"{V}post_layernorm"), f"{V}head.probe", f"{V}head.attention.in_proj_weight",
        f"{V}head.attention.in_proj_bias", *lin(f"{V}head.attention.out_proj"), *lin(f"{V}head.layernorm"),
        *lin(f"{V}head.mlp.fc1"), *lin(f"{V}head.mlp.fc2"),
    )
    projector = ("{projector}mm_input_projection_weight", "{projector}mm_soft_emb_norm.weight")
    text = tuple("{head}" if n == "lm_head.weight" else "{text}" + n.removeprefix("model.") for n in TEXT.named_parameters)
    return (*vision, *projector, *text)


# the tower's nn.LayerNorm params (the HF Trainer does not decay them; their names say no "norm" the
# Trainer's patterns know)
LAYERNORMS = tuple(f"{hf}.{p}" for hf in (f"{V}encoder.layers.$.layer_norm1", f"{V}encoder.layers.$.layer_norm2",
                                          f"{V}post_layernorm", f"{V}head.layernorm") for p in ("weight", "bias"))

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
    layernorms=LAYERNORMS,
)
