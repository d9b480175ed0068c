"""The Mixtral family (MixtralForCausalLM): Mistral's attention with a sparse mixture of SwiGLU
experts as every MLP. `config.py` (MixtralConfig, HF form, rule variables; no JAX),
`params.py` (the param table: HF per-expert names, experts stacked on `[layers, experts]`),
`module.py` (the Flax module, shared with Qwen3-MoE)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.mixtral import config, params

FAMILY = Family(
    name="mixtral",
    config_cls=config.MixtralConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("mixtral",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.mixtral.module:Mixtral",
    hf_name_fixes=config.hf_name_fixes,
)
