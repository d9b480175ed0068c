"""The GPT-2 family: `config.py` (GPT2Config, HF form, rule variables, param shapes, HF name
fixes; no JAX), `module.py` (the Flax module), `hf.rules` (HF names -> params tree)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gpt2 import config

FAMILY = Family(
    name="gpt2",
    config_cls=config.GPT2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("gpt2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gpt2.module:GPT2",
    hf_rules=f"{__name__}:hf.rules",
    hf_name_fixes=config.hf_name_fixes,
)
