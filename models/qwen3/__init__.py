"""The Qwen3 (dense) family: `config.py` (Qwen3Config, HF form, rule variables, param shapes;
no JAX), `module.py` (the Flax module), `hf.rules` (HF names -> params tree)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen3 import config

FAMILY = Family(
    name="qwen3",
    config_cls=config.Qwen3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen3",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    axes_tree=config.axes_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen3.module:Qwen3",
    hf_rules=f"{__name__}:hf.rules",
)
