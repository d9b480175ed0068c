"""The Gemma 3 multimodal wrapper (`Gemma3ForConditionalGeneration`, Gemma 3 4B-27B):
`config.py` (Gemma3MMConfig: the text model's Gemma3Config plus the vision tower's sizes, the
checkpoint's name prefixes and the rest of its config.json; no JAX), `params.py` (the param
table: Gemma 3's text rows under the wrapper's prefix, the SigLIP tower and the projector),
`module.py` (the Flax module: the text forward; the vision params are carried, not run)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gemma3_mm import config, params

FAMILY = Family(
    name="gemma3_mm",
    config_cls=config.Gemma3MMConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gemma3_mm.module:Gemma3MM",
    fit_to_hf_names=config.fit_to_hf_names,
)
