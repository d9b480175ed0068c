"""The Llama 4 multimodal wrapper (`Llama4ForConditionalGeneration`, Llama 4 Scout and Maverick as
released): `config.py` (Llama4MMConfig: the text model's Llama4Config plus the vision tower's
sizes and the rest of its config.json; no JAX), `params.py` (the param table: Llama 4's text
rows under `language_model.`, the vision tower and the projector carried), `module.py` (the
Flax module: the text forward; the vision params are carried, not run)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama4_mm import config, params

FAMILY = Family(
    name="llama4_mm",
    config_cls=config.Llama4MMConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.llama4_mm.module:Llama4MM",
)
