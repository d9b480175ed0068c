"""SmolLM3 family config and its HF form and rule variables (no JAX).

SmolLM3ForCausalLM (huggingface/transformers:src/transformers/models/smollm3/
modeling_smollm3.py, configuration_smollm3.py) is Llama's attention, RoPE, norms and SwiGLU
with one change: layer i applies RoPE to q and k only when `no_rope_layers[i]` is 1
(`SmolLM3Attention.use_rope`); a 0 makes it a NoPE layer (no position signal but the causal
mask). When the config gives no `no_rope_layers`, transformers makes it from
`no_rope_layer_interval` (default 4): `int((i + 1) % interval != 0)`, so layers 3, 7, 11, ...
are NoPE (SmolLM3-3B: 36 layers, 9 NoPE).

HF `config.json` (`from_hf` / `to_hf`): architectures `SmolLM3ForCausalLM` (or, with no
`architectures`, `model_type` "smollm3"), sizes and RoPE read by Llama's reader; absent keys
take transformers' SmolLM3Config defaults: `tie_word_embeddings` true (Llama's is false),
`rope_theta` 2e6 (its `default_theta`), `max_position_embeddings` 32768, `rms_norm_eps` 1e-6.
`no_rope_layers` is kept as read (a list of 0/1, at least one entry per layer, as transformers
indexes it) with `no_rope_layer_interval`, and written back (null when absent). Refused:
`use_sliding_window: true` (transformers then windows the NoPE layers; SmolLM3-3B leaves it
off) and `attention_bias` / `mlp_bias` true (no release has them; Llama's reader refuses them).

`use_rope_layers` is the family's fact (a property): a test turns it into "every layer" to show
the NoPE layers matter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.qwen2.config import refuse_sliding_window

ARCHITECTURE = "SmolLM3ForCausalLM"
MODEL_TYPE = "smollm3"
HF_DEFAULT_THETA = 2000000.0  # SmolLM3Config.default_theta
HF_DEFAULTS = {"tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
               "no_rope_layer_interval": 4}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SmolLM3Config(llama.LlamaConfig):
    """SmolLM3: LlamaConfig's fields plus `no_rope_layers` (per layer 1: RoPE, 0: NoPE, as read;
    empty: `use_rope_layers` makes it from `no_rope_layer_interval`, as transformers does, only
    when asked, so a config of 2**31 layers builds no list) and `no_rope_layer_interval`."""

    tie_word_embeddings: bool = True
    no_rope_layers: tuple[int, ...] = ()
    no_rope_layer_interval: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        check_positive(self, ("no_rope_layer_interval",))
        flags = self.no_rope_layers
        if not isinstance(flags, list | tuple) or any(
            isinstance(f, bool) or f not in (0, 1) for f in flags
        ):
            raise ConfigError(
                f"{where}.no_rope_layers: expected a list of 0 and 1, found {flags!r:.80}"
            )
        if flags and len(flags) < self.num_layers:
            raise ConfigError(
                f"{where}.no_rope_layers: {len(flags)} entries for {self.num_layers} layers; expected one per layer"
            )
        object.__setattr__(self, "no_rope_layers", tuple(int(f) for f in flags))

    @property
    def family(self) -> str:
        return "smollm3"

    @property
    def use_rope_layers(self) -> tuple[bool, ...]:
        """Per layer: RoPE applied to q and k (False: a NoPE layer)."""
        if not self.no_rope_layers:
            every = self.no_rope_layer_interval
            return tuple((i + 1) % every != 0 for i in range(self.num_layers))
        return tuple(bool(f) for f in self.no_rope_layers[: self.num_layers])


def from_hf(d: Mapping[str, Any], source: str) -> SmolLM3Config:
    """A SmolLM3Config from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    refuse_sliding_window(d, source)
    view = {**HF_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    if not any(view.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        view["rope_theta"] = HF_DEFAULT_THETA
    cfg = llama.from_hf(view, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    flags = view.get("no_rope_layers", ())
    try:
        return SmolLM3Config(**fields, no_rope_layers=tuple(flags) if isinstance(flags, list) else flags,
                             no_rope_layer_interval=view["no_rope_layer_interval"])  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: SmolLM3Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a SmolLM3ForCausalLM (Llama's keys;
    `head_dim` is no SmolLM3Config field: written only when it is not hidden_size / num_heads,
    which transformers' attention then reads)."""
    d = llama.to_hf(cfg) | {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "no_rope_layers": list(cfg.no_rope_layers) or None,  # None: transformers makes it
        "no_rope_layer_interval": cfg.no_rope_layer_interval,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    return d


def rule_variables(cfg: SmolLM3Config) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
