"""Gemma 2 family config and its HF form and rule variables (no JAX); also the
pieces of a Gemma config that Gemma 3 (`models.gemma3.config`) reads the same way.

HF `config.json` (`from_hf` / `to_hf`): architectures `Gemma2ForCausalLM` (or, when
`architectures` is absent, `model_type` "gemma2"), read as
huggingface/transformers:src/transformers/models/gemma2/configuration_gemma2.py reads it:
- `layer_types`: one of "sliding_attention" / "full_attention" per layer (transformers 5); when
  absent, the older alternation rule `__post_init__` applies: layer i slides iff (i + 1) % 2,
  so layer 0 is local, layer 1 global, and so on.
- `sliding_window` (default 4096): a local layer's query i sees keys i - window < j <= i.
- `query_pre_attn_scalar` (default 256): the attention scale is `query_pre_attn_scalar ** -0.5`
  (not head_dim's); `attn_logit_softcapping` (50) and `final_logit_softcapping` (30): scores and
  logits become `tanh(x / c) * c` (null: no capping).
- `hidden_activation` must be "gelu_pytorch_tanh" (the only one transformers 5 reads; the legacy
  `hidden_act` key is ignored, as there). `attention_bias` and `use_bidirectional_attention` true
  are refused.
- RoPE from transformers 5's `rope_parameters` or v4's `rope_theta` + `rope_scaling`, read and
  written back unchanged by `models.rope` (`read_hf_rope`, `hf_rope_keys`), as for Llama; any
  rope type `models.rope` implements (Gemma 2 releases use plain RoPE, theta 10000).

Params: `models.gemma2.params` (fp32, kernels `[in, out]`, every layer, local or global, stacked
on one leading `[L]` axis; norm weights stored zero-centred, as HF stores them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama_config
from hybridckpt.models.rope import Scaling, check_config_rope, hf_rope_keys, read_hf_rope

ARCHITECTURE = "Gemma2ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"


def hf_layer_types(d: Mapping[str, Any], num_layers: int, pattern: int) -> tuple[str, ...]:
    """`layer_types` as given, else transformers' rule: layer i slides iff (i + 1) % pattern."""
    given = d.get("layer_types")
    if given is not None:
        return tuple(given) if isinstance(given, list | tuple) else given
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def check_gemma(cfg: Any) -> None:
    """The checks every Gemma config shares (sizes, floats, layer kinds, window, heads)."""
    name = type(cfg).__name__
    ints = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")
    check_positive(cfg, (*ints, "num_kv_heads", "head_dim", "max_position_embeddings"))
    as_floats(cfg, ("rms_norm_eps",))
    for field in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
        value = getattr(cfg, field)
        if value is None and field != "query_pre_attn_scalar":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(f"{name}.{field}: expected a positive number, found {value!r}")
    object.__setattr__(cfg, "tie_word_embeddings", bool(cfg.tie_word_embeddings))
    kinds = cfg.layer_types
    if not isinstance(kinds, tuple) or len(kinds) != cfg.num_layers:
        raise ConfigError(f"{name}.layer_types: expected {cfg.num_layers} entries, found {kinds!r}")
    bad = sorted({k for k in kinds if k not in (SLIDING, FULL)}, key=str)
    if bad:
        raise ConfigError(f"{name}.layer_types: expected {SLIDING!r} or {FULL!r}, found {bad}")
    if SLIDING in kinds:
        check_positive(cfg, ("sliding_window",))
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(
            f"{name}: num_heads {cfg.num_heads} is not a multiple of num_kv_heads "
            f"{cfg.num_kv_heads}"
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"{name}: RoPE needs an even head_dim, found {cfg.head_dim}")


@dataclass(frozen=True)
class Gemma2Config:
    """Gemma 2 (Gemma2ForCausalLM). Field names follow HF's, except the usual renames
    (num_layers, num_heads, num_kv_heads); `rope_theta` / `rope_scaling` as `LlamaConfig`'s
    (`models.rope.Scaling`, None for plain RoPE).

    layer_types: "sliding_attention" / "full_attention" per layer; () means transformers'
    alternation rule (resolved at construction).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = 4096
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        kinds = self.layer_types
        if isinstance(kinds, list):
            kinds = tuple(kinds)
        if kinds == () and isinstance(self.num_layers, int):
            kinds = hf_layer_types({}, self.num_layers, 2)
        object.__setattr__(self, "layer_types", kinds)
        check_gemma(self)
        as_floats(self, ("rope_theta",))
        scaling = check_config_rope(self.rope_theta, self.rope_scaling, "Gemma2Config")
        object.__setattr__(self, "rope_scaling", scaling)

    @property
    def family(self) -> str:
        return "gemma2"

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: True for a local (sliding-window) layer, False for a global one."""
        return tuple(kind == SLIDING for kind in self.layer_types)


# ---------------------------------------------------------------------------------------- HF


def check_hf_gemma(d: Mapping[str, Any], source: str, arch: str) -> None:
    """What a Gemma `config.json` must say for our module to compute what transformers does."""
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
        arch,
    )
    act = d.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ConfigError(
            f"{source}: hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'"
        )
    for key in ("attention_bias", "use_bidirectional_attention"):
        if d.get(key):
            raise ConfigError(f"{source}: {key}=true is not supported; expected false")


def hf_sizes(d: Mapping[str, Any]) -> dict[str, Any]:
    """The size fields every Gemma config reads the same way (head_dim explicit, as HF's)."""
    heads = d["num_attention_heads"]
    return {
        "vocab_size": d["vocab_size"],
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_layers": d["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": d.get("num_key_value_heads") or heads,
        "head_dim": d.get("head_dim") or d["hidden_size"] // heads,
    }


def from_hf(d: Mapping[str, Any], source: str) -> Gemma2Config:
    """A Gemma2Config from an HF `config.json` dict; `source` names the file in errors."""
    check_hf_gemma(d, source, ARCHITECTURE)
    sizes = hf_sizes(d)
    theta, scaling = read_hf_rope(d, source)
    return Gemma2Config(
        **sizes,
        layer_types=hf_layer_types(d, sizes["num_layers"], 2),
        sliding_window=d.get("sliding_window", 4096),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        attn_logit_softcapping=d.get("attn_logit_softcapping", 50.0),
        final_logit_softcapping=d.get("final_logit_softcapping", 30.0),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        max_position_embeddings=d.get("max_position_embeddings", 8192),
    )


def hf_common(cfg: Any, architecture: str, model_type: str) -> dict[str, Any]:
    """The `config.json` keys every Gemma config writes the same way."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def to_hf(cfg: Gemma2Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back (v4 and v5 RoPE keys both written)."""
    return {
        **hf_common(cfg, ARCHITECTURE, "gemma2"),
        **hf_rope_keys(cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings),
    }


# ------------------------------------------------------------------------------------ rules


def rule_variables(cfg: Any) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`): Llama's, same fields."""
    return llama_config.rule_variables(cfg)
