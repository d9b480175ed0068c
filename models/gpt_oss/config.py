"""GPT-OSS family config and its HF form and rule variables (no JAX).

GptOssForCausalLM (huggingface/transformers:src/transformers/models/gpt_oss/modeling_gpt_oss.py,
configuration_gpt_oss.py; OpenAI's gpt-oss-20b / 120b) is a pre-norm decoder whose
- attention is GQA with biases on q, k, v and o (`attention_bias`, true in every release), a
  learned per-head logit (`sinks`) in each softmax's denominator, and layers alternating
  between a sliding window and full causal attention (`layer_types`; when absent, layer i
  slides iff (i + 1) % 2, as `GptOssConfig.__post_init__`); RoPE of any type `models.rope`
  implements, yarn in the releases (`rope_parameters` absent: transformers' default yarn,
  factor 32, beta_fast 32, beta_slow 1, truncate false, original_max_position_embeddings 4096,
  theta 150000);
- MLP is a mixture of `num_local_experts` experts, `num_experts_per_tok` chosen per token by a
  router with a bias (top-k of the logits, then a softmax over the k chosen); each expert a
  clamped SwiGLU with biases: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
  `g = min(gate, limit)` (`swiglu_limit` 7.0, `swiglu_alpha` 1.702), gate and up the even and odd
  columns of the fused `gate_up_proj` `[E, hidden, 2 * intermediate]`;
- RMSNorm as Llama's (`(w * x_fp32).to(dtype)`), untied head by default.

HF `config.json` (`from_hf` / `to_hf`): architectures `GptOssForCausalLM` (or, when
`architectures` is absent, `model_type` "gpt_oss"). Absent keys take GptOssConfig's defaults
(`HF_DEFAULTS`). `experts_per_token` (which OpenAI's converter copies from the original
config beside transformers' keys) is not read: transformers reads `num_experts_per_tok` only.
`hidden_act` other than "silu" is refused (transformers ignores it: the experts' activation is
the clamped SwiGLU above). Training options (`router_aux_loss_coef`, `output_router_logits`,
`attention_dropout`) are not kept. `quantization_config` (MXFP4 releases) is consumed by the
reader, which dequantizes (`hybridckpt.formats.hf.quant`).

Params: `models.gpt_oss.params`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mixtral.config import layer_list
from hybridckpt.models.rope import hf_rope_keys, read_hf_rope

ARCHITECTURE = "GptOssForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
# GptOssConfig's defaults (transformers 5.24) for the keys read here
HF_DEFAULTS: dict[str, Any] = {
    "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True, "head_dim": 64,
}  # fmt: skip
HF_DEFAULT_THETA = 150000.0
HF_DEFAULT_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GptOssConfig(llama.LlamaConfig):
    """GPT-OSS: LlamaConfig's fields (intermediate_size is each expert's SwiGLU width) plus
    `layer_types` (one of "sliding_attention" / "full_attention" per layer), `sliding_window`
    (a sliding layer's query i sees keys i - window < j <= i), `num_experts`,
    `num_experts_per_tok` (top-k), `swiglu_alpha`, `swiglu_limit` and `attention_bias` (biases
    on q, k, v, o)."""

    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = 128
    num_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_positive(self, ("num_experts", "num_experts_per_tok"))
        as_floats(self, ("swiglu_alpha", "swiglu_limit"))
        object.__setattr__(self, "attention_bias", bool(self.attention_bias))
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"{name}: num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}"
            )
        kinds = self.layer_types
        if not kinds:
            kinds = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(self.num_layers))
        if not isinstance(kinds, list | tuple) or len(kinds) != self.num_layers:
            raise ConfigError(f"{name}.layer_types: expected {self.num_layers} entries, found {kinds!r}")
        bad = sorted({str(k) for k in kinds if k not in (SLIDING, FULL)})
        if bad:
            raise ConfigError(f"{name}.layer_types: expected {SLIDING!r} or {FULL!r}, found {bad}")
        object.__setattr__(self, "layer_types", tuple(kinds))
        if SLIDING in kinds:
            check_positive(self, ("sliding_window",))

    @property
    def family(self) -> str:
        return "gpt_oss"

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window."""
        return tuple(k == SLIDING for k in self.layer_types)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts (GPT-OSS: all)."""
        return tuple(range(self.num_layers))


def from_hf(d: Mapping[str, Any], source: str) -> GptOssConfig:
    """A GptOssConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    view = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None or k == "sliding_window"}}
    act = view.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for {ARCHITECTURE}; expected 'silu'")
    if not any(d.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        view["rope_parameters"] = dict(HF_DEFAULT_ROPE)
    if d.get("rope_theta") is None:  # the rope dict's own rope_theta wins (read_hf_rope)
        view["rope_theta"] = HF_DEFAULT_THETA
    theta, scaling = read_hf_rope(view, source)
    kinds = view.get("layer_types")
    if kinds is not None and not isinstance(kinds, list | tuple):
        raise ConfigError(f"{source}: layer_types: expected a list, found {kinds!r}")
    return GptOssConfig(
        vocab_size=view["vocab_size"],
        hidden_size=view["hidden_size"],
        intermediate_size=view["intermediate_size"],
        num_layers=view["num_hidden_layers"],
        num_heads=view["num_attention_heads"],
        num_kv_heads=view.get("num_key_value_heads") or view["num_attention_heads"],
        head_dim=view.get("head_dim"),
        rms_norm_eps=view["rms_norm_eps"],
        rope_theta=theta,
        tie_word_embeddings=bool(view["tie_word_embeddings"]),
        max_position_embeddings=view["max_position_embeddings"],
        rope_scaling=scaling,
        layer_types=tuple(kinds or ()),
        sliding_window=view["sliding_window"],
        num_experts=view["num_local_experts"],
        num_experts_per_tok=view["num_experts_per_tok"],
        swiglu_alpha=view["swiglu_alpha"],
        swiglu_limit=view["swiglu_limit"],
        attention_bias=view["attention_bias"],
    )


def to_hf(cfg: GptOssConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a GptOssForCausalLM (no
    `quantization_config`: the weights are written dequantized)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt_oss",
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
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
    }


def rule_variables(cfg: GptOssConfig) -> dict[str, Any]:
    """Llama's rule variables plus `num_experts`, `moe_layers` ("0,1,...": all) and
    `attention_bias` (the q/k/v/o bias rows' `when`)."""
    return llama.rule_variables(cfg) | {
        "num_experts": cfg.num_experts,
        "moe_layers": layer_list(cfg.moe_layers),
        "attention_bias": cfg.attention_bias,
    }
