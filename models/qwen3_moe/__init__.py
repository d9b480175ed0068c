"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3's attention with a mixture of SwiGLU
experts as MLP (dense layers where `mlp_only_layers` / `decoder_sparse_step` say).
`config.py` (Qwen3MoeConfig, HF form, rule variables; no JAX), `params.py` (the param table:
HF per-expert names, MoE and dense layers stacked apart by index lists), `module.py` (the Flax
module, Mixtral's)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3_moe import config, params

FAMILY = Family(
    name="qwen3_moe",
    config_cls=config.Qwen3MoeConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen3_moe",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3_moe.module:Qwen3Moe",
    hf_name_fixes=config.hf_name_fixes,
)
