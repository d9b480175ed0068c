"""Qwen3-Next (`Qwen3NextForCausalLM`) config and its HF form (no JAX).

Read as huggingface/transformers:src/transformers/models/qwen3_next/configuration_qwen3_next.py
(`Qwen3NextConfig`, model_type "qwen3_next") reads it, transformers' defaults where a key is
absent (head_dim 256, 512 experts, top-10, `norm_topk_prob` true, ...):
- layers: `layer_types` ("linear_attention" / "full_attention"; absent: every
  `full_attention_interval`-th layer (default 4) full, the others linear);
- full attention: Qwen3-MoE's GQA with per-head q/k norms, `q_proj` giving [q_h; gate_h] per
  head, partial rotary `partial_rotary_factor` (default 0.25, read from the top level or the rope
  dict, where transformers 5 keeps it; taken out before `models.rope` reads the rest);
- linear attention (gated delta net): `linear_num_key_heads`, `linear_num_value_heads`,
  `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`;
- MoE as Qwen3-MoE (`decoder_sparse_step`, `mlp_only_layers`, `moe_intermediate_size`) plus a
  shared expert of width `shared_expert_intermediate_size` gated by a sigmoid.
`attention_bias: true` is refused (no release has it). `hidden_act` must be silu.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.mixtral.config import layer_list
from hybridckpt.models.qwen3_moe import config as qwen3_moe

ARCHITECTURE = "Qwen3NextForCausalLM"
KINDS = ("linear_attention", "full_attention")
# transformers' Qwen3NextConfig defaults of the keys this family reads
HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
               "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 32768,
               "rms_norm_eps": 1e-6, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
               "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
               "linear_num_key_heads": 16, "linear_num_value_heads": 32}  # fmt: skip
LINEAR_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
               "linear_num_value_heads")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(qwen3_moe.Qwen3MoeConfig):
    """Qwen3-Next: Qwen3MoeConfig's fields plus the shared expert's width, the gated delta net's
    sizes, the per-layer kinds and the rotary fraction (module docstring)."""

    shared_expert_intermediate_size: int = 512
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        check_positive(self, ("shared_expert_intermediate_size", *LINEAR_KEYS))
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"{where}: linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {self.linear_num_key_heads}")  # fmt: skip
        kinds = self.layer_types
        if (
            not isinstance(kinds, list | tuple)
            or len(kinds) != self.num_layers
            or any(k not in KINDS for k in kinds)
        ):
            raise ConfigError(
                f"{where}.layer_types: expected {self.num_layers} of {list(KINDS)}, found {kinds!r:.120}"
            )
        object.__setattr__(self, "layer_types", tuple(kinds))
        f = self.partial_rotary_factor
        if (
            isinstance(f, bool)
            or not isinstance(f, int | float)
            or not 0 < f <= 1
            or int(self.head_dim * f) % 2
        ):
            raise ConfigError(f"{where}.partial_rotary_factor: expected a fraction in (0, 1] giving an even rotary "
                              f"width of head_dim {self.head_dim}, found {f!r:.40}")  # fmt: skip
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if self.sliding_window is not None:
            raise ConfigError(f"{where}: sliding_window is not supported; expected none")

    @property
    def family(self) -> str:
        return "qwen3_next"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with gated full attention."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Layers with the gated delta net (linear attention)."""
        return tuple(i for i, k in enumerate(self.layer_types) if k == "linear_attention")

    @property
    def rotary_dim(self) -> int:
        """The rotated leading part of each head: int(head_dim * partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim


def _take_partial(d: dict[str, Any], source: str) -> float:
    """`partial_rotary_factor` out of the rope dicts (and the top level), as transformers reads
    it: a rope dict's wins; default 0.25."""
    factor = d.pop("partial_rotary_factor", None)
    for key in ("rope_scaling", "rope_parameters"):
        raw = d.get(key)
        if isinstance(raw, Mapping) and "partial_rotary_factor" in raw:
            raw = dict(raw)
            factor = raw.pop("partial_rotary_factor")
            d[key] = raw
    return 0.25 if factor is None else factor


def from_hf(d: Mapping[str, Any], source: str) -> Qwen3NextConfig:
    """A Qwen3NextConfig from an HF `config.json` dict; `source` names the file in errors."""
    view = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if view.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{source}: hidden_act {view['hidden_act']!r} is not supported; expected 'silu'"
        )
    if view.get("attention_bias"):
        raise ConfigError(
            f"{source}: attention_bias=true is not supported for {ARCHITECTURE}; expected false"
        )
    partial = _take_partial(view, source)
    kinds = view.pop("layer_types", None)
    if kinds is None:
        step = view.get("full_attention_interval", 4)
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ConfigError(
                f"{source}: full_attention_interval must be a positive int, found {step!r:.40}"
            )
        kinds = [KINDS[(i + 1) % step == 0] for i in range(view["num_hidden_layers"])]
    moe = qwen3_moe.from_hf(view, source)
    fields = {f.name: getattr(moe, f.name) for f in dataclasses.fields(moe)}
    try:
        return Qwen3NextConfig(**fields, shared_expert_intermediate_size=view["shared_expert_intermediate_size"],
                               **{k: view[k] for k in LINEAR_KEYS}, layer_types=kinds,
                               partial_rotary_factor=partial)  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Qwen3NextConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Qwen3NextForCausalLM (the rotary
    fraction in `rope_parameters`, where transformers 5 writes it)."""
    d = qwen3_moe.to_hf(cfg)
    for key in ("use_sliding_window", "sliding_window"):
        del d[key]
    d["rope_parameters"] = {
        **d["rope_parameters"],
        "partial_rotary_factor": cfg.partial_rotary_factor,
    }
    return d | {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_next",
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        **{k: getattr(cfg, k) for k in LINEAR_KEYS},
        "layer_types": list(cfg.layer_types),
    }


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors under the per-expert HF names (as Qwen3-MoE)."""
    return qwen3_moe.hf_name_fixes(names)


def rule_variables(cfg: Qwen3NextConfig) -> dict[str, Any]:
    """Qwen3-MoE's rule variables plus the layer lists `attention_layers` / `linear_layers` and
    the gated delta net's row counts the Megatron dialect regroups by (per key head: `linear_key_head_dim`
    rows of q and of k, `linear_value_group_dim` of v and of z, `linear_value_heads_per_key` of b
    and of a; `linear_key_dim` / `linear_value_dim` in all)."""
    per_key = cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return qwen3_moe.rule_variables(cfg) | {
        "attention_layers": layer_list(cfg.attention_layers),
        "linear_layers": layer_list(cfg.linear_layers),
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim,
        "linear_value_heads_per_key": per_key,
        "linear_value_group_dim": per_key * cfg.linear_value_head_dim,
        "linear_key_dim": cfg.linear_key_dim,
        "linear_value_dim": cfg.linear_value_dim,
    }
