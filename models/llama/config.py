"""Llama family config and its HF / Meta forms, rule variables and param shapes (no JAX).

Two external forms are read:
- HF `config.json` (`from_hf` / `to_hf`): architectures `LlamaForCausalLM` (or, when
  `architectures` is absent, `model_type` "llama"). RoPE is read from transformers v4's
  `rope_theta` + `rope_scaling` or v5's `rope_parameters`; only the plain ("default") RoPE is
  implemented, any other `rope_type` is a ConfigError.
- Meta `params.json` (`config_from_meta_params`): `dim`, `n_layers`, `n_heads`, `n_kv_heads`,
  `vocab_size` (-1 in Llama 1/2: the tokenizer's size must be passed), `multiple_of`,
  `ffn_dim_multiplier`, `norm_eps`, `rope_theta`; the MLP width is computed exactly as
  meta-llama/llama:llama/model.py `FeedForward.__init__` does. Meta checkpoints are untied.

`shape_tree` is the tree `models.llama.module.Llama` builds (see the `Params` list there: fp32,
kernels `[in, out]`, per-layer params stacked on a leading `[L]` axis); exports and name checks
use it, and `tests/families/test_models.py` checks it against `jax.eval_shape` of the module's init.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from models.config_checks import as_floats, check_positive, hf_rope_theta, require
from models.errors import ConfigError

ARCHITECTURE = "LlamaForCausalLM"


@dataclass(frozen=True)
class LlamaConfig:
    """Llama family (Llama 1/2/3 without RoPE scaling, TinyLlama, ...).

    head_dim: None means hidden_size // num_heads (resolved at construction).
    intermediate_size: the SwiGLU width (`gate`/`up` out features).
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
        object.__setattr__(self, "tie_word_embeddings", bool(self.tie_word_embeddings))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"LlamaConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig: RoPE needs an even head_dim, found {self.head_dim}")

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
    require(
        d,
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ),
        source,
        ARCHITECTURE,
    )
    return LlamaConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=hf_rope_theta(d, source),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
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
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
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
    are given they must agree. Defaults follow meta-llama/llama:llama/model.py `ModelArgs`.
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
    if d.get("use_scaled_rope"):
        raise ConfigError(
            f"{source}: use_scaled_rope=true (Llama 3.1 RoPE scaling) is not implemented; "
            f"only plain RoPE is supported"
        )
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
        rope_theta=float(d.get("rope_theta", 10000.0)),
        tie_word_embeddings=False,
        max_position_embeddings=d.get("max_seq_len", 2048),
    )


# ---------------------------------------------------------------------- rules and shapes


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


def shape_tree(cfg: LlamaConfig) -> dict:
    """Nested dicts (the params' structure) of shape tuples; every param is fp32."""
    L, E, M, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tree = {
        "embed": {"embedding": (V, E)},
        "layers": {
            "attn_norm": {"scale": (L, E)},
            "mlp_norm": {"scale": (L, E)},
            "q": {"kernel": (L, E, q)},
            "k": {"kernel": (L, E, kv)},
            "v": {"kernel": (L, E, kv)},
            "o": {"kernel": (L, q, E)},
            "gate": {"kernel": (L, E, M)},
            "up": {"kernel": (L, E, M)},
            "down": {"kernel": (L, M, E)},
        },
        "final_norm": {"scale": (E,)},
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": (E, V)}
    return tree
