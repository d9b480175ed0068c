"""The Llama 4 text family (`Llama4ForCausalLM`): Llama's decoder with MoE layers interleaved
with dense ones (top-k sigmoid router scaling the expert input, fused experts, a shared expert),
chunked local attention, NoPE layers with attention temperature tuning, a weightless L2 q/k norm
after RoPE, and RoPE on interleaved pairs. `config.py` (Llama4Config, HF form, rule variables;
no JAX), `params.py` (the param table), `module.py` (the Flax module). The multimodal wrapper
`Llama4ForConditionalGeneration` is the family `llama4_mm` (`models/llama4_mm/`)."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama4 import config, params

FAMILY = Family(
    name="llama4",
    config_cls=config.Llama4Config,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=(config.MODEL_TYPE,),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.llama4.module:Llama4",
)
