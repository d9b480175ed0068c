"""What the Qwen vision-language wrappers (`Qwen3VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`) share in their HF config and names (no JAX).

A wrapper's `config.json` nests the text model's config under `text_config` (transformers 5.x;
Qwen2.5-VL's released files are flat: the text keys at the top level) and the vision tower's
under `vision_config`, beside the token ids. Read (`read`):
- the text model by its text family's reader (`Wrapper.text_from_hf`: Qwen3's or Qwen2's), on the
  text dict filled with transformers' text-config defaults where a key is absent
  (`Wrapper.text_defaults`, rope_theta included: Qwen3-VL 5e5, Qwen2.5-VL 1e6, not Llama's 1e4);
- M-RoPE: `mrope_section` (and Qwen3-VL's `mrope_interleaved` key) taken out of the rope dict
  (`rope_parameters`, or v4's `rope_scaling` where not empty; transformers' own precedence)
  before the text reader sees it; a legacy `type: "mrope"` is rope type default (transformers'
  `Qwen2_5_VLTextConfig.convert_rope_params_to_dict`). Absent: the family's default section;
- the tower's sizes (`Wrapper.vision_keys`: HF key -> (config field, transformers' default));
- the head's tying: `tie_word_embeddings` at the top level (transformers 5 ties by the wrapper's
  own config), for Qwen2.5-VL also a text config's true (its `__post_init__` forwards it);
- every other top-level key as read (`hf_rest`, JSON text), written back unchanged by `write`
  (so the export's vision_config and token ids are the source's; the text config is rewritten
  by the text family, nested, with the M-RoPE keys put back in its rope dict).
Names (`fit_to_hf_names`): the text prefix and the tower's are read off the tensor names
(`Wrapper.text_prefixes` / `vision_prefixes`, the first transformers 5.24's default save); the
export writes the names it read. The head is `lm_head.weight` in every spelling.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import (
    MAX_SIZE,
    check_choice,
    check_json_object,
    check_positive,
)
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.qwen3_vl.mrope import check_section

ROPE_KEYS = ("rope_scaling", "rope_parameters")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
DEEPSTACK = "vision_deepstack_layers"  # Qwen3-VL's one list-valued tower field


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """One wrapper's constants (see the module docstring)."""

    architecture: str
    model_type: str
    text_model_type: str
    text_from_hf: Callable[[Mapping[str, Any], str], Any]
    text_to_hf: Callable[[Any], dict[str, Any]]
    text_defaults: Mapping[str, Any]
    mrope_default: tuple[int, int, int]
    interleaved: bool
    vision_keys: Mapping[str, tuple[str, Any]]
    text_prefixes: tuple[str, ...]
    vision_prefixes: tuple[str, ...]
    text_ties: bool  # a text_config's tie_word_embeddings: true ties the head too
    flat_text: bool  # a config.json with no text_config holds the text keys at the top level
    vision_marker: str = "patch_embed.proj.weight"


def check_fields(cfg: Any, w: Wrapper) -> None:
    """The wrapper fields of a config (`__post_init__`): prefixes, section, sizes, hf_rest."""
    where = type(cfg).__name__
    check_choice(cfg, "text_prefix", w.text_prefixes)
    check_choice(cfg, "vision_prefix", w.vision_prefixes)
    section = check_section(cfg.mrope_section, cfg.head_dim, w.interleaved, f"{where}")
    object.__setattr__(cfg, "mrope_section", section)
    check_positive(cfg, tuple(field for field, _ in w.vision_keys.values() if field != DEEPSTACK))
    if any(field == DEEPSTACK for field, _ in w.vision_keys.values()):
        v = getattr(cfg, DEEPSTACK)
        if (not isinstance(v, list | tuple) or len(v) > MAX_SIZE
                or any(isinstance(i, bool) or not isinstance(i, int) for i in v)):  # fmt: skip
            raise ConfigError(
                f"{where}.{DEEPSTACK}: expected a list of layer indices, found {v!r:.60}"
            )
        object.__setattr__(cfg, DEEPSTACK, tuple(v))
    if cfg.mrope_interleaved_key is not None:
        object.__setattr__(cfg, "mrope_interleaved_key", bool(cfg.mrope_interleaved_key))
    check_json_object(cfg)


def _text_dict(d: Mapping[str, Any], w: Wrapper, source: str) -> tuple[dict[str, Any], str]:
    tc = d.get("text_config")
    if tc is None and w.flat_text:
        return {
            k: v for k, v in d.items() if k not in ("vision_config", "architectures", "model_type")
        }, source
    if not isinstance(tc, Mapping):
        raise ConfigError(
            f"{source}: {w.architecture} needs a text_config object, found {tc!r:.60}"
        )
    return dict(tc), f"{source}: text_config"


def _take_mrope(tc: dict[str, Any], w: Wrapper, where: str) -> tuple[Any, bool | None]:
    """(mrope_section, the mrope_interleaved key or None) taken out of the text dict's rope dict
    (module doc), the dict left as a plain text family reads it."""
    section, interleaved = None, None
    chosen = next((k for k in ROPE_KEYS if tc.get(k)), None)
    for key in ROPE_KEYS:
        raw = tc.get(key)
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: {key} must be an object or null, found {raw!r:.60}")
        raw = dict(raw)
        got = raw.pop("mrope_section", None), raw.pop("mrope_interleaved", None)
        if "mrope" in (raw.get("type"), raw.get("rope_type")):
            raw.pop("type", None)
            raw["rope_type"] = "default"
        if key == chosen:
            section, interleaved = got
        tc[key] = raw
    if section is None:
        section = w.mrope_default
    if interleaved is not None and not isinstance(interleaved, bool):
        raise ConfigError(
            f"{where}: mrope_interleaved must be true or false, found {interleaved!r:.40}"
        )
    return section, interleaved


def read(cls: type, w: Wrapper, d: Mapping[str, Any], source: str) -> Any:
    """A `cls` config (the text family's config class plus the wrapper's fields) from an HF
    `config.json` dict; `source` names the file in errors."""
    tc, where = _text_dict(d, w, source)
    section, interleaved_key = _take_mrope(tc, w, where)
    tc = {**w.text_defaults, **{k: v for k, v in tc.items() if v is not None}}
    tied = d.get("tie_word_embeddings", False) or (
        w.text_ties and tc.get("tie_word_embeddings", False)
    )
    tc["tie_word_embeddings"] = bool(tied)
    text = w.text_from_hf(tc, where)
    v = d.get("vision_config") or {}
    if not isinstance(v, Mapping):
        raise ConfigError(f"{source}: vision_config must be an object, found {v!r:.60}")
    vision = {field: v.get(key, default) for key, (field, default) in w.vision_keys.items()}
    skip = {"text_config", "architectures", "model_type", "tie_word_embeddings"}
    if "text_config" not in d and w.flat_text:  # the text keys are the text family's
        skip |= set(w.text_to_hf(text)) | set(ROPE_KEYS) | {"rope_theta"}
    rest = {k: v for k, v in d.items() if k not in skip}
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(text)}
    try:
        return cls(**fields, **vision, mrope_section=section, mrope_interleaved_key=interleaved_key,
                   hf_rest=json.dumps(rest, sort_keys=True))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def write(w: Wrapper, cfg: Any) -> dict[str, Any]:
    """The `config.json` dict: the source's top-level keys as read, the text config written by
    the text family (nested, its `architectures` left out, model_type the wrapper's text type),
    the M-RoPE keys back in its rope dicts."""
    tc = w.text_to_hf(cfg)
    del tc["architectures"]
    tc["model_type"] = w.text_model_type
    mrope = {"mrope_section": list(cfg.mrope_section)}
    if cfg.mrope_interleaved_key is not None:
        mrope["mrope_interleaved"] = cfg.mrope_interleaved_key
    for key in ROPE_KEYS:
        if tc.get(key) is not None:
            tc[key] = {**tc[key], **mrope}
    rest = json.loads(cfg.hf_rest)
    return {"architectures": [w.architecture], "model_type": w.model_type, **rest, "text_config": tc,
            "tie_word_embeddings": cfg.tie_word_embeddings}  # fmt: skip


def fit_to_hf_names(w: Wrapper, cfg: Any, names: Collection[str]) -> Any:
    """`cfg` with the prefixes the tensor `names` use (a part whose marker tensor is absent keeps
    cfg's: the rules then report the names they cannot map)."""
    found: dict[str, str] = {}
    for field, marker, allowed in (("text_prefix", "embed_tokens.weight", w.text_prefixes),
                                   ("vision_prefix", w.vision_marker, w.vision_prefixes)):  # fmt: skip
        for prefix in allowed:
            if prefix + marker in names:
                found[field] = prefix
    return dataclasses.replace(cfg, **found)


def rule_variables(cfg: Any, text_variables: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """The text family's rule variables plus the prefixes `{text}` and `{vision}` of the table's
    HF names."""
    return text_variables(cfg) | {"text": cfg.text_prefix, "vision": cfg.vision_prefix}
