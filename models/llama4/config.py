"""Llama 4 text family (`Llama4ForCausalLM`) config and its HF form and rule variables (no JAX).

Llama 4 (huggingface/transformers:src/transformers/models/llama4/modeling_llama4.py and
configuration_llama4.py, transformers 5.24 `Llama4TextConfig`) is Llama's pre-norm GQA decoder
with these facts, each a field here:
- MoE layers interleaved with dense ones: `moe_layers` as given, else every
  `interleave_moe_layer_step`-th layer (`range(step - 1, L, step)`); an MoE layer's MLP is a
  top-k (`num_experts_per_tok`, 1 in the releases) SIGMOID router whose score scales each chosen
  expert's INPUT, `num_local_experts` SwiGLU experts of width `intermediate_size` (the fused
  `gate_up_proj` `[X, E, 2 M]`, `down_proj` `[X, M, E]`, stored `[in, out]`), plus a shared SwiGLU
  expert of the same width; a dense layer's MLP is a SwiGLU of width `intermediate_size_mlp`.
- NoPE layers: `no_rope_layers[i]` 1 means layer i uses RoPE, 0 means none (default: every
  `no_rope_layer_interval`-th layer is NoPE); a NoPE layer scales its queries by the attention
  temperature `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1` when
  `attn_temperature_tuning`.
- Chunked local attention: a layer whose `layer_types[i]` is "chunked_attention" (default: the
  RoPE layers, when `attention_chunk_size` is set) lets query i see key j only when both lie in
  the same `attention_chunk_size` chunk (j <= i as ever).
- `use_qk_norm`: a weightless L2 (RMS) norm of q and k, AFTER RoPE, on RoPE layers only.
- RoPE on interleaved (complex) pairs `(x[2i], x[2i+1])`, of any rope type `models.rope` knows
  (the releases: llama3 scaling; Scout's low_freq_factor == high_freq_factor, which transformers
  accepts).

HF `config.json` (`from_hf` / `to_hf`): architectures `Llama4ForCausalLM` (or, when absent,
`model_type` "llama4_text"). Absent keys take Llama4TextConfig's defaults (head_dim 128, not
hidden / heads; rope_theta 500000; num_key_value_heads 8; ...). `attention_bias: true` (no
release) and a `hidden_act` other than silu are refused. Router training options
(`output_router_logits`, `router_aux_loss_coef`, `router_jitter_noise`) are not kept.

Params: `models.llama4.params`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mixtral.config import layer_list

ARCHITECTURE = "Llama4ForCausalLM"
MODEL_TYPE = "llama4_text"
CHUNKED, FULL = "chunked_attention", "full_attention"
# transformers 5.24 Llama4TextConfig's defaults of the keys read here
HF_DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
               "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
               "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
               "num_experts_per_tok": 1, "num_local_experts": 16, "moe_layers": None, "interleave_moe_layer_step": 1,
               "use_qk_norm": True, "no_rope_layers": None, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
               "layer_types": None, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}  # fmt: skip
HF_DEFAULT_THETA = 500000.0  # Llama4TextConfig.default_theta


def _int_list(v: Any, where: str) -> tuple[int, ...]:
    if not isinstance(v, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise ConfigError(f"{where}: expected a list of ints, found {v!r:.80}")
    return tuple(v)


@dataclasses.dataclass(frozen=True)
class Llama4Config(llama.LlamaConfig):
    """Llama 4 text: LlamaConfig's fields (`intermediate_size` is each expert's and the shared
    expert's width) plus the Llama 4 facts of the module docstring. `moe_layers`,
    `no_rope_layers` and `layer_types` are resolved (never None) by `from_hf`; a config built by
    hand may leave them None to get transformers' defaults."""

    rope_theta: float = HF_DEFAULT_THETA
    intermediate_size_mlp: int = 16384
    num_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: tuple[int, ...] | None = None
    interleave_moe_layer_step: int = 1
    no_rope_layers: tuple[int, ...] | None = None
    no_rope_layer_interval: int = 4
    attention_chunk_size: int | None = 8192
    layer_types: tuple[str, ...] | None = None
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        check_positive(self, ("intermediate_size_mlp", "num_experts", "num_experts_per_tok",
                              "interleave_moe_layer_step", "no_rope_layer_interval", "floor_scale"))  # fmt: skip
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"{where}: num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts "
                              f"{self.num_experts}")  # fmt: skip
        if self.attention_chunk_size is not None:
            check_positive(self, ("attention_chunk_size",))
        if isinstance(self.attn_scale, bool) or not isinstance(self.attn_scale, int | float):
            raise ConfigError(f"{where}.attn_scale: expected a number, found {self.attn_scale!r:.60}")
        object.__setattr__(self, "attn_scale", float(self.attn_scale))
        for flag in ("use_qk_norm", "attn_temperature_tuning"):
            object.__setattr__(self, flag, bool(getattr(self, flag)))
        n = self.num_layers
        moe = self.moe_layers
        if moe is None:  # transformers: every step-th layer, the last of each step
            moe = range(self.interleave_moe_layer_step - 1, n, self.interleave_moe_layer_step)
        moe = _int_list(list(moe), f"{where}.moe_layers")
        if any(not 0 <= i < n for i in moe):
            raise ConfigError(f"{where}.moe_layers: {list(moe)[:16]} has a layer outside 0..{n - 1}")
        object.__setattr__(self, "moe_layers", tuple(sorted(set(moe))))
        rope = self.no_rope_layers
        if not rope:  # transformers: an absent or empty list is the interval's pattern
            rope = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        rope = _int_list(rope, f"{where}.no_rope_layers")
        if len(rope) < n or any(v not in (0, 1) for v in rope):
            raise ConfigError(f"{where}.no_rope_layers: expected at least {n} entries of 0 (NoPE) or 1 (RoPE), "
                              f"found {list(rope)[:16]}")  # fmt: skip
        object.__setattr__(self, "no_rope_layers", rope)
        types = self.layer_types
        if types is None:  # transformers: the RoPE layers are chunked when a chunk size is set
            types = [CHUNKED if r and self.attention_chunk_size is not None else FULL for r in rope[:n]]
        if not isinstance(types, list | tuple) or len(types) != n or any(t not in (CHUNKED, FULL) for t in types):
            raise ConfigError(f"{where}.layer_types: expected {n} of {[CHUNKED, FULL]}, found {types!r:.120}")
        if CHUNKED in types and self.attention_chunk_size is None:
            raise ConfigError(f"{where}: layer_types has {CHUNKED!r} layers but attention_chunk_size is null")
        object.__setattr__(self, "layer_types", tuple(types))

    @property
    def family(self) -> str:
        return "llama4"

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a dense SwiGLU of width `intermediate_size_mlp`."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Per layer: RoPE (True) or NoPE (False)."""
        return tuple(bool(v) for v in self.no_rope_layers[: self.num_layers])

    @property
    def chunked_layers(self) -> tuple[bool, ...]:
        """Per layer: chunked local attention (True) or full causal attention."""
        return tuple(t == CHUNKED for t in self.layer_types)


def text_fields(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The Llama4Config fields of a Llama4TextConfig dict (the CausalLM's config.json, or the
    wrapper's `text_config`), transformers' defaults filled in."""
    view = {**HF_DEFAULTS, **d}
    if view.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported for Llama 4; expected false")
    if not any(view.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        view["rope_theta"] = HF_DEFAULT_THETA
    cfg = llama.from_hf({k: v for k, v in view.items() if k != "attention_bias"}, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    opt = {k: view[k] for k in ("moe_layers", "no_rope_layers", "layer_types")}
    for k, v in opt.items():
        if v is not None and not isinstance(v, list | tuple):
            raise ConfigError(f"{source}: {k} must be a list or null, found {v!r:.60}")
    return fields | {
        "intermediate_size_mlp": view["intermediate_size_mlp"],
        "num_experts": view["num_local_experts"],
        "num_experts_per_tok": view["num_experts_per_tok"],
        "moe_layers": None if opt["moe_layers"] is None else tuple(opt["moe_layers"]),
        "interleave_moe_layer_step": view["interleave_moe_layer_step"],
        "no_rope_layers": None if opt["no_rope_layers"] is None else tuple(opt["no_rope_layers"]),
        "no_rope_layer_interval": view["no_rope_layer_interval"],
        "attention_chunk_size": view["attention_chunk_size"],
        "layer_types": None if opt["layer_types"] is None else tuple(opt["layer_types"]),
        "use_qk_norm": view["use_qk_norm"],
        "attn_temperature_tuning": view["attn_temperature_tuning"],
        "floor_scale": view["floor_scale"],
        "attn_scale": view["attn_scale"],
    }


def from_hf(d: Mapping[str, Any], source: str) -> Llama4Config:
    """A Llama4Config from an HF `config.json` dict; `source` names the file in errors."""
    try:
        return Llama4Config(**text_fields(d, source))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def text_to_hf(cfg: Llama4Config) -> dict[str, Any]:
    """The Llama4TextConfig keys of `cfg` (model_type "llama4_text", no architectures)."""
    d = llama.to_hf(cfg)
    for k in ("architectures", "mlp_bias"):
        del d[k]
    return d | {
        "model_type": MODEL_TYPE,
        "intermediate_size_mlp": cfg.intermediate_size_mlp,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_layers": list(cfg.moe_layers),
        "interleave_moe_layer_step": cfg.interleave_moe_layer_step,
        "no_rope_layers": list(cfg.no_rope_layers),
        "no_rope_layer_interval": cfg.no_rope_layer_interval,
        "attention_chunk_size": cfg.attention_chunk_size,
        "layer_types": list(cfg.layer_types),
        "use_qk_norm": cfg.use_qk_norm,
        "attn_temperature_tuning": cfg.attn_temperature_tuning,
        "floor_scale": cfg.floor_scale,
        "attn_scale": cfg.attn_scale,
    }


def to_hf(cfg: Llama4Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Llama4ForCausalLM."""
    return {"architectures": [ARCHITECTURE], **text_to_hf(cfg)}


def rule_variables(cfg: Llama4Config) -> dict[str, Any]:
    """Llama's rule variables plus `num_experts` and the layer lists `moe_layers` /
    `dense_layers` ("1,3"), with `has_moe_layers` / `has_dense_layers` for `when` clauses."""
    return llama.rule_variables(cfg) | {
        "num_experts": cfg.num_experts,
        "moe_layers": layer_list(cfg.moe_layers),
        "dense_layers": layer_list(cfg.dense_layers),
        "has_moe_layers": bool(cfg.moe_layers),
        "has_dense_layers": bool(cfg.dense_layers),
    }
