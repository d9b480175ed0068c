"""The Qwen2-MoE family (Qwen2MoeForCausalLM, Qwen1.5-MoE / Qwen2-57B-A14B): Qwen2's attention
(q/k/v biases) with, as MLP, a mixture of SwiGLU experts plus one shared SwiGLU expert scaled by
a sigmoid gate (dense layers where `mlp_only_layers` / `decoder_sparse_step` say).
`config.py` (Qwen2MoeConfig, HF form, rule variables; no JAX), `params.py` (the param table),
`module.py` (the Flax module)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen2_moe import config, params

FAMILY = Family(
    name="qwen2_moe",
    config_cls=config.Qwen2MoeConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen2_moe.module:Qwen2Moe",
    hf_name_fixes=config.hf_name_fixes,
)
