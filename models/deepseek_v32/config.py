"""DeepSeek V3.2 family config and its HF form and rule variables (no JAX).

DeepSeek V3.2 (`DeepseekV32ForCausalLM`, deepseek-ai/DeepSeek-V3.2-Exp, V3.2) is DeepSeek V3
(`models.deepseek_v3.config`: MLA, sigmoid router with its correction bias, groups, shared
experts, first dense layers, MTP modules) plus a lightning indexer in every attention layer.
Read from huggingface/transformers:src/transformers/models/deepseek_v32/configuration_deepseek_v32.py
and modular_deepseek_v32.py (5.24):
- `index_n_heads` (64), `index_head_dim` (128), `index_topk` (2048): the indexer's heads, their
  width (its first `qk_rope_head_dim` values rotated) and how many keys each query keeps.
- The indexer's q is `wq_b` of MLA's normed q latent, so `q_lora_rank` must be set (transformers'
  V3.2 attention has no plain `q_proj`); `q_lora_rank: null` is refused.
- MLA's RoPE is always interleaved (transformers' config has no `rope_interleave`: a file saying
  `rope_interleave: false` is refused).
- `mlp_layer_types` (written by transformers' save): `"dense"` then `"sparse"` layers; the number
  of leading dense layers is `first_k_dense_replace` (a dense layer after a sparse one is
  refused: the layer groups of `models.moe` are a prefix). `layer_types` is every layer
  `"indexed_attention"`.
- Defaults of a key the file leaves out are transformers' DeepseekV32Config ones where they differ
  from V3's (`max_position_embeddings` 163840); `num_nextn_predict_layers` absent is 0
  (DeepseekV32Config has no such key; DeepSeek's own config.json says 1, its MTP module
  `model.layers.61.*`, a whole decoder layer with its indexer).

Params: `models.deepseek_v32.params` (V3's table with the indexer's rows in each layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.deepseek_v3 import config as v3
from hybridckpt.models.errors import ConfigError

ARCHITECTURE = "DeepseekV32ForCausalLM"
MODEL_TYPE = "deepseek_v32"
# transformers' DeepseekV32Config defaults that differ from DeepseekV3Config's, and its own keys
HF_DEFAULTS: Mapping[str, Any] = {
    "max_position_embeddings": 163840,
    "num_nextn_predict_layers": 0,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
}
LAYER_TYPE = "indexed_attention"


@dataclass(frozen=True)
class DeepseekV32Config(v3.DeepseekV3Config):
    """DeepSeek V3 (every field as there) with the lightning indexer: `index_n_heads` heads of
    `index_head_dim` (the first `qk_rope_head_dim` of each rotated half-split, the rest not),
    keeping the `index_topk` best keys per query. `q_lora_rank` is required."""

    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64

    def __post_init__(self) -> None:
        where = type(self).__name__
        if self.q_lora_rank is None:
            raise ConfigError(f"{where}: q_lora_rank is None; the indexer's q needs the q latent "
                              f"(expected a positive int)")  # fmt: skip
        if not self.rope_interleave:
            raise ConfigError(
                f"{where}: rope_interleave False; DeepSeek V3.2's MLA RoPE is interleaved"
            )
        super().__post_init__()
        check_positive(self, ("index_topk", "index_head_dim", "index_n_heads"))
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"{where}: index_head_dim {self.index_head_dim} is below qk_rope_head_dim "
                f"{self.qk_rope_head_dim} (the indexer rotates its first qk_rope_head_dim values)"
            )

    @property
    def family(self) -> str:
        return "deepseek_v32"


def _dense_layers(d: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`first_k_dense_replace` from `mlp_layer_types` when the file has it (what transformers
    follows), checked to be dense layers then sparse ones; `layer_types` checked."""
    out: dict[str, Any] = {}
    layers = d["num_hidden_layers"]
    kinds = d.get("mlp_layer_types")
    if kinds is not None:
        ok = (
            isinstance(kinds, list)
            and len(kinds) == layers
            and all(k in ("dense", "sparse") for k in kinds)
        )
        dense = kinds.index("sparse") if ok and "sparse" in kinds else len(kinds) if ok else 0
        if not ok or any(k != "sparse" for k in kinds[dense:]):
            raise ConfigError(
                f"{source}: mlp_layer_types {kinds!r}: expected {layers} entries, 'dense' ones then "
                f"'sparse' ones"
            )
        out["first_k_dense_replace"] = dense
    types = d.get("layer_types")
    if types is not None and (
        not isinstance(types, list) or set(types) - {LAYER_TYPE} or len(types) != layers
    ):
        raise ConfigError(
            f"{source}: layer_types {types!r}: expected {layers} times {LAYER_TYPE!r}"
        )
    return out


def from_hf(d: Mapping[str, Any], source: str) -> DeepseekV32Config:
    """A DeepseekV32Config from an HF `config.json` dict; `source` names the file in errors."""
    if d.get("rope_interleave", True) is not True:
        raise ConfigError(f"{source}: rope_interleave {d['rope_interleave']!r}; expected true "
                          f"(DeepSeek V3.2's MLA RoPE is interleaved)")  # fmt: skip
    if "q_lora_rank" in d and d["q_lora_rank"] is None:
        raise ConfigError(f"{source}: q_lora_rank is null; expected a positive int (the indexer's q "
                          f"is made from the q latent)")  # fmt: skip
    require(d, v3.HF_REQUIRED, source, ARCHITECTURE)
    merged = {**HF_DEFAULTS, **d, **_dense_layers(d, source)}
    merged.pop("rope_interleave", None)
    base = v3.from_hf(merged, source)
    try:
        return DeepseekV32Config(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            index_topk=merged["index_topk"],
            index_head_dim=merged["index_head_dim"],
            index_n_heads=merged["index_n_heads"],
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: DeepseekV32Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a DeepseekV32ForCausalLM."""
    out = v3.to_hf(cfg)
    out.pop("rope_interleave")
    if not cfg.num_nextn_predict_layers:
        out.pop("num_nextn_predict_layers")
    dense = cfg.num_dense_layers
    return {
        **out,
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "mlp_layer_types": ["dense"] * dense + ["sparse"] * (cfg.num_layers - dense),
        "index_topk": cfg.index_topk,
        "index_head_dim": cfg.index_head_dim,
        "index_n_heads": cfg.index_n_heads,
    }


def rule_variables(cfg: DeepseekV32Config) -> dict[str, Any]:
    """DeepSeek V3's (`models.deepseek_v3.config.rule_variables`); the indexer's rows test no
    flag."""
    return v3.rule_variables(cfg)
