"""ERNIE 4.5 dense family config (`Ernie4_5ForCausalLM`, e.g. ERNIE-4.5-0.3B) and its HF form and
rule variables (no JAX); the MoE models (`models.ernie4_5_moe`) build on it.

Ernie4_5ForCausalLM (huggingface/transformers:src/transformers/models/ernie4_5/modeling_ernie4_5.py
and configuration_ernie4_5.py, 5.24) is Llama's pre-norm block with
- **interleaved RoPE**: the pairs (x0, x1), (x2, x3), ... of each head turned by one frequency each
  (`rotate_half` of even/odd lanes, cos/sin repeated per pair), in fp32, written back interleaved
  (`apply_rotary_pos_emb`), where Llama pairs the two halves;
- `use_bias`: biases on q, k, v, o and on the MLP's gate, up and down (Baidu's Paddle models);
- tied embeddings by default.

HF `config.json`: architectures `Ernie4_5ForCausalLM` (or `model_type` "ernie4_5"). Sizes and RoPE
by Llama's reader, with Ernie4_5Config's defaults for absent keys: `head_dim` 128 (null: hidden /
heads), `rope_theta` 500000, `rms_norm_eps` 1e-5, `tie_word_embeddings` true,
`max_position_embeddings` 131072, `use_bias` false.

`interleaved_rope` is the family's fact as a property (always true): a test turns it off to show
it matters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama

ARCHITECTURE = "Ernie4_5ForCausalLM"
MODEL_TYPE = "ernie4_5"
DEFAULT_THETA = 500000.0  # Ernie4_5Config.default_theta (and Ernie4_5_MoeConfig's)
HF_DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 131072}


@dataclasses.dataclass(frozen=True)
class Ernie45Config(llama.LlamaConfig):
    """ERNIE 4.5 dense: LlamaConfig's fields plus `use_bias` (q/k/v/o and MLP biases)."""

    use_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "use_bias", bool(self.use_bias))

    @property
    def family(self) -> str:
        return "ernie4_5"

    @property
    def interleaved_rope(self) -> bool:
        """RoPE pairs adjacent lanes (x0, x1), ... (Llama pairs the halves)."""
        return True


def llama_view(d: Mapping[str, Any], head_dim_default: int | None) -> dict[str, Any]:
    """`d` with ERNIE's defaults filled in, as Llama's reader reads it: absent keys of
    HF_DEFAULTS, rope_theta 500000 when no RoPE key is given, `head_dim` `head_dim_default` when
    absent (null stays null: hidden / heads)."""
    view = {**HF_DEFAULTS, **d}
    if not any(d.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        view["rope_theta"] = DEFAULT_THETA
    if "head_dim" not in d:
        view["head_dim"] = head_dim_default
    view.pop("use_bias", None)
    return view


def read_llama(view: Mapping[str, Any], source: str) -> llama.LlamaConfig:
    """Llama's reading of `view`, every ConfigError naming `source` (the config's own checks too)."""
    try:
        return llama.from_hf(view, source)
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def from_hf(d: Mapping[str, Any], source: str) -> Ernie45Config:
    """An Ernie45Config from an HF `config.json` dict; `source` names the file in errors."""
    cfg = read_llama(llama_view(d, 128), source)
    return Ernie45Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)},
                         use_bias=d.get("use_bias") or False)  # fmt: skip


def to_hf(cfg: Ernie45Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as an Ernie4_5ForCausalLM."""
    d = llama.to_hf(cfg) | {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "use_bias": cfg.use_bias}
    del d["attention_bias"], d["mlp_bias"]
    return d


def rule_variables(cfg: Ernie45Config) -> dict[str, Any]:
    """Llama's rule variables plus `use_bias` (the biases' rows)."""
    return llama.rule_variables(cfg) | {"use_bias": cfg.use_bias}
