"""GPT-2 family config and its HF form, rule variables and HF name fixes (no JAX).

HF `config.json` (`from_hf` / `to_hf`): architectures `GPT2LMHeadModel` (or, when
`architectures` is absent, `model_type` "gpt2"); only the plain GPT-2 variant is read
(gelu_new, scaled attention weights, head tied to `wte`, no cross-attention).

Params: `models.gpt2.params` (fp32, kernels `[in, out]`, per-layer params stacked on a leading
`[L]` axis).

HF names: `GPT2LMHeadModel.save_pretrained` writes `transformer.`-prefixed names, a bare
`GPT2Model` writes them without the prefix (huggingface/transformers:
src/transformers/models/gpt2/modeling_gpt2.py, `base_model_prefix = "transformer"`);
`hf_name_fixes` renames the latter to the former.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.errors import ConfigError

ARCHITECTURE = "GPT2LMHeadModel"


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2 family (GPT2LMHeadModel: learned positions, gelu_new, head tied to `wte`).

    n_inner: None means 4 * n_embd (resolved at construction).
    """

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    n_inner: int | None = None
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_inner is None and isinstance(self.n_embd, int):
            object.__setattr__(self, "n_inner", 4 * self.n_embd)
        check_positive(
            self, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")
        )
        as_floats(self, ("layer_norm_epsilon",))
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPT2Config: n_embd {self.n_embd} is not divisible by n_head {self.n_head}"
            )

    @property
    def family(self) -> str:
        return "gpt2"

    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# ---------------------------------------------------------------------------------------- HF


def from_hf(d: Mapping[str, Any], source: str) -> GPT2Config:
    """A GPT2Config from an HF `config.json` dict; `source` names the file in errors."""
    act = d.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(
            f"{source}: activation_function {act!r} is not supported; expected 'gelu_new'"
        )
    checks = {
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "tie_word_embeddings": True,
        "add_cross_attention": False,
    }
    for key, expected in checks.items():
        if key in d and bool(d[key]) != expected:
            raise ConfigError(f"{source}: {key}={d[key]!r} is not supported; expected {expected}")
    require(d, ("n_embd", "n_layer", "n_head"), source, ARCHITECTURE)
    return GPT2Config(
        vocab_size=d.get("vocab_size", 50257),
        n_positions=d.get("n_positions", 1024),
        n_embd=d["n_embd"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        n_inner=d.get("n_inner"),
        layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
    )


def to_hf(cfg: GPT2Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.n_positions,
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.n_inner,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
    }


def hf_name_fixes(names: Collection[str]) -> str:
    """Rules adding the `transformer.` prefix when no name has it (a bare GPT2Model's file)."""
    if any(name.startswith("transformer.") for name in names):
        return ""
    return "lm_head.weight -> lm_head.weight\n* -> transformer.*\n"


# ------------------------------------------------------------------------------------ rules


def rule_variables(cfg: GPT2Config) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`)."""
    return {
        "num_heads": cfg.n_head,
        "num_kv_heads": cfg.n_head,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.n_layer,
        "intermediate_size": cfg.n_inner,
        "tied": True,
    }
