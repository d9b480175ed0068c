"""Llama family config and its HF / Meta forms and rule variables (no JAX).

Two external forms are read:
- HF `config.json` (`from_hf` / `to_hf`): architectures `LlamaForCausalLM` (or, when
  `architectures` is absent, `model_type` "llama"). RoPE is read from transformers v4's
  `rope_theta` + `rope_scaling` or v5's `rope_parameters` by `models.rope.read_hf_rope`: rope
  types default, linear, dynamic, llama3 and yarn. The scaling dict is kept as read
  (`rope_scaling`, frozen) and `to_hf` writes it back unchanged (`models.rope.hf_rope_keys`:
  `rope_theta`, `rope_scaling` and the standardized `rope_parameters`).
- Meta `params.json` (`config_from_meta_params`): `dim`, `n_layers`, `n_heads`, `n_kv_heads`,
  `vocab_size` (-1 in Llama 1/2: the tokenizer's size must be passed), `multiple_of`,
  `ffn_dim_multiplier`, `norm_eps`, `rope_theta`, `use_scaled_rope`; the MLP width is computed
  exactly as meta-llama/llama:llama/model.py `FeedForward.__init__` does. Meta checkpoints are
  untied. `use_scaled_rope: true` (Llama 3.1-3.3) is the llama3 rope type with the factors
  meta-llama/llama-models:models/llama3/reference_impl/model.py `apply_scaling` hard-codes
  (scale_factor 8, low_freq_factor 1, high_freq_factor 4, old_context_len 8192), written as the
  `rope_scaling` dict of HF's Llama 3.1 conversions.

The params (shapes, logical axes, HF names) are declared once, in `models.llama.params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.rope import Scaling, check_config_rope, hf_rope_keys, read_hf_rope

ARCHITECTURE = "LlamaForCausalLM"
HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads")  # fmt: skip

# Meta's `use_scaled_rope: true` as HF's Llama 3.1 config.json spells it (meta-llama/llama-models:
# models/llama3/reference_impl/model.py `apply_scaling`: 8, 1, 4, 8192; ModelArgs rope_theta
# 500000); max_position_embeddings 131072 as HF's conversions of Llama 3.1 say.
META_LLAMA3_SCALING: Scaling = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 8192),
    ("rope_type", "llama3"),
)
META_LLAMA3_THETA = 500000.0
META_LLAMA3_MAX_POSITIONS = 131072


@dataclass(frozen=True)
class LlamaConfig:
    """Llama family (Llama 1/2/3.x, TinyLlama, ...).

    head_dim: None means hidden_size // num_heads (resolved at construction).
    intermediate_size: the SwiGLU width (`gate`/`up` out features).
    rope_scaling: the HF RoPE scaling dict as read (`models.rope.Scaling`: its items, hashable;
    a dict or pairs are accepted and frozen), None for plain RoPE; its rope_theta, if any, must
    equal `rope_theta`. `dynamic` and yarn use `max_position_embeddings`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rope_scaling: Scaling | None = None

    def __post_init__(self) -> None:
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
        check_positive(self, (*ints, "num_kv_heads", "max_position_embeddings"))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"LlamaConfig: hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        check_positive(self, ("head_dim",))
        as_floats(self, ("rms_norm_eps", "rope_theta"))
        where = type(self).__name__
        scaling = check_config_rope(self.rope_theta, self.rope_scaling, where)
        object.__setattr__(self, "rope_scaling", scaling)
        object.__setattr__(self, "tie_word_embeddings", bool(self.tie_word_embeddings))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{where}: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{where}: RoPE needs an even head_dim, found {self.head_dim}")

    @property
    def family(self) -> str:
        return "llama"


# ---------------------------------------------------------------------------------------- HF


def from_hf(d: Mapping[str, Any], source: str) -> LlamaConfig:
    """A LlamaConfig from an HF `config.json` dict; `source` names the file in errors."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ConfigError(f"{source}: {key}=true is not supported; expected false")
    require(d, HF_REQUIRED, source, ARCHITECTURE)
    theta, scaling = read_hf_rope(d, source)
    return LlamaConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rope_scaling=scaling,
    )


def to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back (v4 and v5 RoPE keys both written)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        **hf_rope_keys(cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


# -------------------------------------------------------------------------------------- Meta


def meta_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU width of a Meta Llama checkpoint.

    Exactly meta-llama/llama:llama/model.py `FeedForward.__init__` (called with 4 * dim), also
    meta-llama/llama3:llama/model.py: int(2 * 4*dim / 3), times the multiplier (truncated), then
    rounded up to a multiple of `multiple_of`.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_from_meta_params(
    d: Mapping[str, Any], vocab_size: int | None = None, source: str = "params.json"
) -> LlamaConfig:
    """A LlamaConfig (untied) from Meta's `params.json`.

    vocab_size: required when params.json has -1 (Llama 1/2: the tokenizer's size); when both
    are given they must agree. Defaults follow meta-llama/llama:llama/model.py `ModelArgs`, and
    with `use_scaled_rope` meta-llama/llama-models:models/llama3/args.py (rope_theta 500000).
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, found {type(d).__name__}")
    require(d, ("dim", "n_layers", "n_heads"), source, "Meta Llama")
    dim, heads = d["dim"], d["n_heads"]
    file_vocab = d.get("vocab_size", -1)
    if file_vocab is None or file_vocab == -1:
        if vocab_size is None:
            raise ConfigError(
                f"{source}: vocab_size is {file_vocab!r}; pass the tokenizer's vocabulary size "
                f"(--vocab-size)"
            )
    elif vocab_size is not None and vocab_size != file_vocab:
        raise ConfigError(
            f"{source}: vocab_size {file_vocab} disagrees with the given vocab_size {vocab_size}"
        )
    else:
        vocab_size = file_vocab
    scaled = d.get("use_scaled_rope", False)
    if not isinstance(scaled, bool):
        raise ConfigError(f"{source}: use_scaled_rope must be true or false, found {scaled!r}")
    multiple_of = d.get("multiple_of", 256)
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ConfigError(f"{source}: multiple_of must be a positive int, found {multiple_of!r}")
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=meta_ffn_hidden_dim(dim, multiple_of, d.get("ffn_dim_multiplier")),
        num_layers=d["n_layers"],
        num_heads=heads,
        num_kv_heads=d.get("n_kv_heads") or heads,
        head_dim=None,
        rms_norm_eps=float(d.get("norm_eps", 1e-5)),
        rope_theta=float(d.get("rope_theta", META_LLAMA3_THETA if scaled else 10000.0)),
        tie_word_embeddings=False,
        max_position_embeddings=d.get("max_seq_len", META_LLAMA3_MAX_POSITIONS if scaled else 2048),
        rope_scaling=META_LLAMA3_SCALING if scaled else None,
    )


# ------------------------------------------------------------------------------------ rules


def rule_variables(cfg: LlamaConfig) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`)."""
    return {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size,
        "tied": cfg.tie_word_embeddings,
    }
