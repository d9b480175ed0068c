"""The Mistral family (MistralForCausalLM): Llama's tensors, names and block, plus a sliding
attention window.

What Mistral adds to Llama (huggingface/transformers:src/transformers/models/mistral/
modeling_mistral.py, configuration_mistral.py): `sliding_window` (4096 in Mistral 7B v0.1, null
from v0.2 on): every layer's query i attends keys j with i - window < j <= i
(`create_sliding_window_causal_mask`), which changes attention only when seq > window. The
tensors, their HF names and the forward pass are otherwise Llama's, RoPE scaling included, so
the family reuses them: `config.py` (MistralConfig, a LlamaConfig with `sliding_window`),
`module.py` (Llama's module with its window hook set), and Llama's param table.
"""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.llama import params as llama_params
from hybridckpt.models.mistral import config

FAMILY = Family(
    name="mistral",
    config_cls=config.MistralConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("mistral",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=llama_params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.mistral.module:Mistral",
)
