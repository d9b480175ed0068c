"""Phi-3 family config (Phi-3 / 3.5 / Phi-4 / Phi-4-mini) and its HF form and rule variables
(no JAX).

Phi3ForCausalLM (huggingface/transformers:src/transformers/models/phi3/modeling_phi3.py and
configuration_phi3.py) is Llama's pre-norm block with:
- fused projections: `self_attn.qkv_proj` `[Q + 2 KV, E]` (rows q | k | v, each head-major) and
  `mlp.gate_up_proj` `[2 M, E]` (rows gate | up: `chunk(2)`, gate first);
- partial rotary: RoPE over the first `int(head_dim * partial_rotary_factor)` dims of each head,
  the rest passed through (`apply_rotary_pos_emb`; Phi-4-mini 0.75);
- longrope (`rope_type` "longrope"; legacy "su" and "yarn" are read as longrope, as
  `Phi3Config.convert_rope_params_to_dict` does): per-frequency `short_factor` / `long_factor`
  lists and an attention factor (`models.phi3.rope`);
- an optional `sliding_window` (keys within that many positions, transformers'
  `create_sliding_window_causal_mask`; None: plain causal).

HF `config.json`: the RoPE dict is v4's `rope_scaling` (+ top-level `rope_theta`,
`partial_rotary_factor`) or v5's `rope_parameters`; as transformers, a non-empty `rope_scaling`
wins, the dict's own `rope_theta` / `partial_rotary_factor` win over the top-level ones, and the
top-level `original_max_position_embeddings` (transformers' default 4096) always wins over the
dict's (`standardize_rope_params`'s Phi-3 exception). Types other than default and longrope are
refused, as transformers refuses them. `rms_norm_eps` defaults to 1e-5 (Phi3Config's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.rope import Scaling, freeze, thaw

ARCHITECTURE = "Phi3ForCausalLM"
MODEL_TYPE = "phi3"
HF_DEFAULTS = {"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096,
               "max_position_embeddings": 4096}  # fmt: skip
LONGROPE_KEYS = ("short_factor", "long_factor", "factor", "attention_factor")


@dataclasses.dataclass(frozen=True)
class Phi3Config(llama.LlamaConfig):
    """Phi-3: LlamaConfig's fields (`rope_scaling` always None: Llama's rope types are not
    Phi-3's) plus:

    partial_rotary_factor: the fraction of head_dim RoPE turns (rotary dims
      `int(head_dim * f)`, even).
    longrope: None (plain RoPE) or the longrope dict, frozen: `short_factor`, `long_factor`
      (rotary_dim / 2 numbers each), optional `factor`, `attention_factor`.
    original_max_position_embeddings: the pretraining length: a forward longer than it uses
      `long_factor`.
    sliding_window: None, or the window of every layer.
    """

    partial_rotary_factor: float = 1.0
    longrope: Scaling | None = None
    original_max_position_embeddings: int = 4096
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        if self.rope_scaling is not None:
            raise ConfigError(f"{where}: rope_scaling must be None; Phi-3's RoPE is `longrope`")
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ConfigError(f"{where}.partial_rotary_factor: expected 0 < f <= 1, found {f!r}")
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(f"{where}: rotary dims {self.rotary_dim} (head_dim {self.head_dim} "
                              f"* partial_rotary_factor {f}) must be even and positive")  # fmt: skip
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(
                f"{where}.sliding_window: expected a positive int or None, found {w!r}"
            )
        orig = self.original_max_position_embeddings
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise ConfigError(
                f"{where}.original_max_position_embeddings: expected a positive int, found {orig!r}"
            )
        object.__setattr__(self, "longrope", _check_longrope(self.longrope, self.rotary_dim, where))

    @property
    def family(self) -> str:
        return "phi3"

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns: `int(head_dim * partial_rotary_factor)`."""
        return int(self.head_dim * self.partial_rotary_factor)


def _check_longrope(raw: Any, rotary_dim: int, where: str) -> Scaling | None:
    frozen = freeze(raw, f"{where}.longrope")
    if frozen is None:
        return None
    d = thaw(frozen)
    unknown = sorted(set(d) - set(LONGROPE_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}.longrope: unknown keys {unknown}; expected {list(LONGROPE_KEYS)}"
        )
    for key in ("short_factor", "long_factor"):
        v = d.get(key)
        ok = isinstance(v, list) and all(
            isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in v
        )
        if not ok or len(v) != rotary_dim // 2:
            raise ConfigError(f"{where}.longrope: {key} must be {rotary_dim // 2} positive numbers "
                              f"(rotary dims / 2), found {v!r:.80}")  # fmt: skip
    for key in ("factor", "attention_factor"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v <= 0):
            raise ConfigError(
                f"{where}.longrope: {key} must be a positive number or null, found {v!r}"
            )
    return frozen


# ---------------------------------------------------------------------------------------- HF


def _hf_rope(d: Mapping[str, Any], source: str) -> tuple[float, float, dict | None]:
    """(rope_theta, partial_rotary_factor, longrope dict or None) of a Phi-3 config dict."""
    chosen, key = None, "rope_parameters"
    for name in ("rope_scaling", "rope_parameters"):
        raw = d.get(name)
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"{source}: {name} must be an object or null, found {raw!r:.80}")
        if raw and chosen is None:
            chosen, key = dict(raw), name
    chosen = chosen or {}
    theta = chosen.get("rope_theta", d.get("rope_theta")) or 10000.0
    factor = chosen.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    kind = chosen.get("rope_type", chosen.get("type", "default"))
    if kind in ("su", "yarn"):  # transformers' Phi-3 reads both as longrope
        kind = "longrope"
    if kind == "default":
        return theta, factor, None
    if kind != "longrope":
        raise ConfigError(f"{source}: {key} rope_type {kind!r} is not supported by Phi-3; expected "
                          f"'default' or 'longrope'")  # fmt: skip
    return theta, factor, {k: chosen[k] for k in LONGROPE_KEYS if chosen.get(k) is not None}


def from_hf(d: Mapping[str, Any], source: str) -> Phi3Config:
    """A Phi3Config from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    theta, partial, longrope = _hf_rope(d, source)
    view = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    for key in ("rope_scaling", "rope_parameters", "partial_rotary_factor"):
        view.pop(key, None)
    view["rope_theta"] = theta
    cfg = llama.from_hf(view, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    try:
        return Phi3Config(
            **fields,
            partial_rotary_factor=partial,
            longrope=longrope,
            original_max_position_embeddings=view["original_max_position_embeddings"],
            sliding_window=d.get("sliding_window"),
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def rope_parameters(cfg: Phi3Config) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of `cfg` (as Phi3Config standardizes it)."""
    d = {"rope_type": "longrope" if cfg.longrope else "default", "rope_theta": cfg.rope_theta,
         "partial_rotary_factor": cfg.partial_rotary_factor}  # fmt: skip
    if cfg.longrope:
        d |= thaw(cfg.longrope) | {
            "original_max_position_embeddings": cfg.original_max_position_embeddings
        }
    return d


def to_hf(cfg: Phi3Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Phi3ForCausalLM (v5's
    `rope_parameters`; v4's `rope_theta`, `rope_scaling` and `partial_rotary_factor`)."""
    d = llama.to_hf(cfg)
    for key in ("attention_bias", "mlp_bias", "rope_parameters", "rope_scaling"):
        del d[key]
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    longrope = thaw(cfg.longrope)
    return d | {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "rope_scaling": None if longrope is None else {"rope_type": "longrope", **longrope},
        "rope_parameters": rope_parameters(cfg),
        "original_max_position_embeddings": cfg.original_max_position_embeddings,
        "sliding_window": cfg.sliding_window,
    }


def rule_variables(cfg: Phi3Config) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
