"""The Gemma 2 family: `config.py` (Gemma2Config, HF form, rule variables, param shapes; no JAX),
`module.py` (the Flax module, and how the alternating local/global layers are stacked),
`hf.rules` (HF names -> params tree). Gemma 3 (`models.gemma3`) builds on these."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gemma2 import config

FAMILY = Family(
    name="gemma2",
    config_cls=config.Gemma2Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("gemma2",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    shape_tree=config.shape_tree,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gemma2.module:Gemma2",
    hf_rules=f"{__name__}:hf.rules",
)
