"""The SmolLM3 family (SmolLM3ForCausalLM): Llama's tensors, names and block, with RoPE left out
of every `no_rope_layer_interval`-th layer (NoPE layers, `no_rope_layers`), tied by default.
`config.py` (SmolLM3Config, HF form, rule variables; no JAX), `module.py` (the Flax module);
the params are Llama's table (`models.llama.params`: the same HF names)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama import params as llama_params
from hybridckpt.models.smollm3 import config

FAMILY = Family(
    name="smollm3",
    config_cls=config.SmolLM3Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=llama_params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.smollm3.module:SmolLM3",
)
