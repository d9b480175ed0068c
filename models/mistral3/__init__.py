"""The Mistral 3 multimodal wrapper (`Mistral3ForConditionalGeneration`: Mistral-Small-3.1 / 3.2,
Magistral Small): `config.py` (Mistral3Config: the text model's MistralConfig plus the Pixtral
tower's and projector's sizes, the checkpoint's name prefixes and the rest of its config.json;
no JAX), `params.py` (the param table: Mistral's text rows under the wrapper's prefix, the
Pixtral tower and the projector carried), `module.py` (the text forward; the vision params are
carried, not run)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.mistral3 import config, params

FAMILY = Family(
    name="mistral3",
    config_cls=config.Mistral3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.mistral3.module:Mistral3",
    fit_to_hf_names=config.fit_to_hf_names,
)
