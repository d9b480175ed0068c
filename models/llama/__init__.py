"""The Llama family: `config.py` (LlamaConfig, HF and Meta forms, rule variables, param
shapes; no JAX), `module.py` (the Flax module), `hf.rules` (HF names -> params tree)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama import config

FAMILY = Family(
    name="llama",
    config_cls=config.LlamaConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("llama",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    axes_tree=config.axes_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.llama.module:Llama",
    hf_rules=f"{__name__}:hf.rules",
    config_from_meta=config.config_from_meta_params,
)
