"""PaddleNLP's Llama (`LlamaForCausalLM`, paddlenlp/transformers/llama/modeling.py): structured
names under `base_model_prefix` "llama", Linear weights `[in, out]`, fused qkv / gate_up optional.
`paddlenlp.rules` maps them to HF names, `paddlenlp_tp.rules` merges their tensor-parallel
shards (`_get_tensor_parallel_mappings`); the Llama-like families read the same two files."""

PREFIX = "llama"  # the structured names' prefix (`LlamaPretrainedModel.base_model_prefix`)
