"""The GPT-OSS family (GptOssForCausalLM, OpenAI's gpt-oss-20b / 120b): attention with sinks,
biases and alternating sliding / full layers, yarn RoPE, a top-k mixture of clamped-SwiGLU
experts with router and expert biases. `config.py` (GptOssConfig, HF form, rule variables; no
JAX), `params.py` (the param table: transformers' runtime names, experts fused per layer),
`module.py` (the Flax module). MXFP4 releases are dequantized by the HF reader
(`hybridckpt.formats.hf.quant`) to the names this table reads."""

from __future__ import annotations

from hybridckpt.models.family import Family
from hybridckpt.models.gpt_oss import config, params

FAMILY = Family(
    name="gpt_oss",
    config_cls=config.GptOssConfig,
    hf_architectures=(config.ARCHITECTURE,),
    hf_model_types=("gpt_oss",),
    config_from_hf=config.from_hf,
    config_to_hf=config.to_hf,
    table=params.TABLE,
    rule_variables=config.rule_variables,
    module="hybridckpt.models.gpt_oss.module:GptOss",
)
