"""Model configs of the Llama and GPT-2 families, and their HF / Meta / our-own JSON forms.

Three external forms are read:
- HF `config.json` (`config_from_hf` / `config_to_hf`): architectures `LlamaForCausalLM` or
  `GPT2LMHeadModel` (or, when `architectures` is absent, `model_type` "llama" / "gpt2"). RoPE is
  read from transformers v4's `rope_theta` + `rope_scaling` or v5's `rope_parameters`; only the
  plain ("default") RoPE is implemented, any other `rope_type` is a ConfigError.
- Meta `params.json` (`config_from_meta_params`): `dim`, `n_layers`, `n_heads`, `n_kv_heads`,
  `vocab_size` (-1 in Llama 1/2: the tokenizer's size must be passed), `multiple_of`,
  `ffn_dim_multiplier`, `norm_eps`, `rope_theta`; the MLP width is computed exactly as
  meta-llama/llama:llama/model.py `FeedForward.__init__` does. Meta checkpoints are untied.
- Our own JSON (`config_to_dict` / `config_from_dict`): the dataclass fields plus `"family"`,
  stored in trainer state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.errors import ConfigError

LLAMA_ARCHS = ("LlamaForCausalLM",)
GPT2_ARCHS = ("GPT2LMHeadModel",)
SUPPORTED = "architectures LlamaForCausalLM, GPT2LMHeadModel (model_type llama, gpt2)"


def _check_positive(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive int, found {value!r}"
            )


def _as_floats(cfg: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(
                f"{type(cfg).__name__}.{name}: expected a positive number, found {value!r}"
            )
        object.__setattr__(cfg, name, float(value))


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
        _check_positive(self, (*ints, "num_kv_heads", "max_position_embeddings"))
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"LlamaConfig: hidden_size {self.hidden_size} is not divisible by num_heads "
                    f"{self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive(self, ("head_dim",))
        _as_floats(self, ("rms_norm_eps", "rope_theta"))
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
        _check_positive(
            self, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner")
        )
        _as_floats(self, ("layer_norm_epsilon",))
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


ModelConfig = LlamaConfig | GPT2Config
_FAMILIES: dict[str, type] = {"llama": LlamaConfig, "gpt2": GPT2Config}


# ---------------------------------------------------------------------------------------- HF


def _require(d: Mapping[str, Any], keys: tuple[str, ...], source: str, arch: str) -> None:
    missing = [k for k in keys if d.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: {arch} config needs keys {list(keys)}; missing {missing}")


def _family_of_hf(d: Mapping[str, Any], source: str) -> str:
    archs = d.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    for arch in archs:
        if arch in LLAMA_ARCHS:
            return "llama"
        if arch in GPT2_ARCHS:
            return "gpt2"
    if archs:
        raise ConfigError(
            f"{source}: architectures {list(archs)} (model_type {d.get('model_type')!r}) is not "
            f"supported; supported: {SUPPORTED}"
        )
    model_type = d.get("model_type")
    if model_type in _FAMILIES:
        return model_type
    raise ConfigError(
        f"{source}: model_type {model_type!r} with no architectures is not supported; "
        f"supported: {SUPPORTED}"
    )


def _hf_rope_theta(d: Mapping[str, Any], source: str) -> float:
    """rope_theta from v4 (`rope_theta`, `rope_scaling`) or v5 (`rope_parameters`) keys."""
    theta = d.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: {key} must be an object or null, found {rope!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ConfigError(
                f"{source}: {key} type {kind!r} is not implemented; only plain RoPE "
                f"(rope_scaling null / rope_type 'default') is supported"
            )
        if rope.get("rope_theta") is not None:
            theta = rope["rope_theta"]
    return float(10000.0 if theta is None else theta)


def _llama_from_hf(d: Mapping[str, Any], source: str) -> LlamaConfig:
    arch = "LlamaForCausalLM"
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ConfigError(f"{source}: {key}=true is not supported; expected false")
    _require(
        d,
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ),
        source,
        arch,
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
        rope_theta=_hf_rope_theta(d, source),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
    )


def _gpt2_from_hf(d: Mapping[str, Any], source: str) -> GPT2Config:
    arch = "GPT2LMHeadModel"
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
    _require(d, ("n_embd", "n_layer", "n_head"), source, arch)
    return GPT2Config(
        vocab_size=d.get("vocab_size", 50257),
        n_positions=d.get("n_positions", 1024),
        n_embd=d["n_embd"],
        n_layer=d["n_layer"],
        n_head=d["n_head"],
        n_inner=d.get("n_inner"),
        layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
    )


def config_from_hf(d: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Our config from an HF `config.json` dict; `source` names the file in error messages."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, found {type(d).__name__}")
    if _family_of_hf(d, source) == "llama":
        return _llama_from_hf(d, source)
    return _gpt2_from_hf(d, source)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back (v4 and v5 RoPE keys both written).

    `torch_dtype` / `dtype` are left to the caller (they describe the saved weights).
    """
    if isinstance(cfg, LlamaConfig):
        return {
            "architectures": ["LlamaForCausalLM"],
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
    if isinstance(cfg, GPT2Config):
        return {
            "architectures": ["GPT2LMHeadModel"],
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
    raise ConfigError(
        f"config_to_hf: expected LlamaConfig or GPT2Config, found {type(cfg).__name__}"
    )


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
    d: Mapping[str, Any], vocab_size: int | None = None, *, source: str = "params.json"
) -> LlamaConfig:
    """A LlamaConfig (untied) from Meta's `params.json`.

    vocab_size: required when params.json has -1 (Llama 1/2: the tokenizer's size); when both
    are given they must agree. Defaults follow meta-llama/llama:llama/model.py `ModelArgs`.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"{source}: expected a JSON object, found {type(d).__name__}")
    _require(d, ("dim", "n_layers", "n_heads"), source, "Meta Llama")
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


# ------------------------------------------------------------------------------ our own JSON


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able dict: the dataclass fields plus "family"."""
    if not isinstance(cfg, LlamaConfig | GPT2Config):
        raise ConfigError(f"config_to_dict: expected a model config, found {type(cfg).__name__}")
    return {"family": cfg.family, **dataclasses.asdict(cfg)}


def config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Inverse of `config_to_dict`; unknown families or keys are a ConfigError."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"model config: expected a JSON object, found {type(d).__name__}")
    family = d.get("family")
    cls = _FAMILIES.get(family)
    if cls is None:
        raise ConfigError(
            f"model config: family {family!r} is unknown; expected one of {sorted(_FAMILIES)}"
        )
    fields = {f.name for f in dataclasses.fields(cls)}
    rest = {k: v for k, v in d.items() if k != "family"}
    unknown = sorted(set(rest) - fields)
    if unknown:
        raise ConfigError(
            f"model config ({family}): unknown keys {unknown}; expected {sorted(fields)}"
        )
    try:
        return cls(**rest)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"model config ({family}): {e}") from None
