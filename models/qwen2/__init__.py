"""The Qwen2 / Qwen2.5 family: `config.py` (Qwen2Config, HF form, rule variables, param shapes;
no JAX), `module.py` (the Flax module, whose block Qwen3 shares), `hf.rules` (HF names ->
params tree)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.qwen2 import config

FAMILY = Family(
    name="qwen2",
    config_cls=config.Qwen2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("qwen2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    axes_tree=config.axes_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.qwen2.module:Qwen2",
    hf_rules=f"{__name__}:hf.rules",
)
