"""The Qwen3-MoE family (Qwen3MoeForCausalLM): Qwen3's attention with a mixture of SwiGLU
experts as MLP (dense layers where `mlp_only_layers` / `decoder_sparse_step` say).
`config.py` (Qwen3MoeConfig, HF form, rule variables, param shapes; no JAX), `module.py` (the
Flax module, Mixtral's), `hf.rules` (HF per-expert names -> params tree, MoE and dense layers
stacked apart by index lists)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3_moe import config

FAMILY = Family(
    name="qwen3_moe",
    config_cls=config.Qwen3MoeConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen3_moe",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3_moe.module:Qwen3Moe",
    hf_rules=f"{__name__}:hf.rules",
    hf_name_fixes=config.hf_name_fixes,
)
