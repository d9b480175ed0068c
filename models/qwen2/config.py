"""Qwen2 / Qwen2.5 family config and its HF form and rule variables (no JAX).

Qwen2ForCausalLM is Llama with biases on the q, k and v projections (o_proj has none), read from
huggingface/transformers:src/transformers/models/qwen2/modeling_qwen2.py (`Qwen2Attention`) and
configuration_qwen2.py. Small sizes (0.5B-3B) tie the embeddings (`tie_word_embeddings`).

HF `config.json` (`from_hf` / `to_hf`): architectures `Qwen2ForCausalLM` (or, when
`architectures` is absent, `model_type` "qwen2"). The fields Qwen shares with Llama (sizes,
`head_dim` if given, `rms_norm_eps`, RoPE from `rope_theta` + `rope_scaling` or
`rope_parameters`) are read by Llama's own reader (`models.llama.config.from_hf`), so RoPE is
parsed, checked and written back exactly as for Llama: the rope types of `models.rope` (Qwen2.5's
long-context configs use yarn), the scaling dict kept as read. Sliding-window attention
(`use_sliding_window: true`, or `layer_types` naming "sliding_attention") is not implemented and
is a ConfigError; released Qwen2/2.5 models leave it off (their `sliding_window` value is then
unused, and not kept).

`Qwen2Config` is a `LlamaConfig` (same fields and checks) whose attention options say what the
family has: `qkv_bias` True, `o_bias` False, `qk_norm` False (the shared block
`models.qwen2.module.QwenBlock` applies q/k norms by `qk_norm`; the biases are the table's,
`models.qwen2.params`). `models.qwen3.config` reuses `llama_fields` and `llama_to_hf` from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama

ARCHITECTURE = "Qwen2ForCausalLM"
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen2Config(llama.LlamaConfig):
    """Qwen2 / Qwen2.5 (dense): LlamaConfig's fields; q, k and v projections carry biases."""

    @property
    def family(self) -> str:
        return "qwen2"

    @property
    def qkv_bias(self) -> bool:
        """q, k, v projections have biases (`layers.{q,k,v}.bias`)."""
        return True

    @property
    def o_bias(self) -> bool:
        """The output projection has a bias (`layers.o.bias`)."""
        return False

    @property
    def qk_norm(self) -> bool:
        """q and k are RMS-normalised per head before RoPE (`layers.{q,k}_norm.scale`)."""
        return False


# ---------------------------------------------------------------------------------------- HF


def refuse_sliding_window(d: Mapping[str, Any], source: str) -> None:
    """Sliding-window attention is not implemented: refuse a config that turns it on."""
    if d.get("use_sliding_window"):
        raise ConfigError(
            f"{source}: use_sliding_window=true (layers from max_window_layers "
            f"{d.get('max_window_layers')!r} on attend within sliding_window "
            f"{d.get('sliding_window')!r} tokens) is not implemented; expected false"
        )
    kinds = d.get("layer_types")
    if kinds is None:
        return
    if not isinstance(kinds, list):
        raise ConfigError(f"{source}: layer_types must be a list or null, found {kinds!r}")
    other = sorted({str(k) for k in kinds} - {"full_attention"})
    if other:
        raise ConfigError(
            f"{source}: layer_types {other} are not implemented; expected only 'full_attention'"
        )


def llama_fields(d: Mapping[str, Any], source: str, arch: str, **overrides: Any) -> dict[str, Any]:
    """The LlamaConfig fields of a Qwen `config.json` dict, read by Llama's reader (RoPE
    included); `overrides` replace keys of `d` first (e.g. a family's default head_dim)."""
    require(d, HF_REQUIRED, source, arch)
    refuse_sliding_window(d, source)
    # Qwen's own attention options are read by the family; Llama's reader refuses them.
    view = {k: v for k, v in d.items() if k != "attention_bias"} | overrides
    cfg = llama.from_hf(view, source)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def from_hf(d: Mapping[str, Any], source: str) -> Qwen2Config:
    """A Qwen2Config from an HF `config.json` dict; `source` names the file in errors."""
    return Qwen2Config(**llama_fields(d, source, ARCHITECTURE))


def llama_to_hf(cfg: llama.LlamaConfig, arch: str, model_type: str) -> dict[str, Any]:
    """Llama's `config.json` dict of `cfg` (RoPE keys included) as a Qwen `arch`, sliding
    window off; Llama's `attention_bias` / `mlp_bias` keys are left out."""
    d = llama.to_hf(cfg)
    for key in ("attention_bias", "mlp_bias"):
        del d[key]
    return d | {"architectures": [arch], "model_type": model_type, "use_sliding_window": False}


def to_hf(cfg: Qwen2Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Qwen2ForCausalLM. `head_dim` is not a
    field of transformers' Qwen2Config (modeling_qwen2.py reads it when present): it is written
    only when it differs from hidden_size / num_heads, so the config loads back unchanged."""
    d = llama_to_hf(cfg, ARCHITECTURE, "qwen2")
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    return d


# ------------------------------------------------------------------------------------ rules


def rule_variables(cfg: Qwen2Config) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
