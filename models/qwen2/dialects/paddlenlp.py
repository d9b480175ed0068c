"""PaddleNLP's Qwen2 (paddlenlp/transformers/qwen2/modeling.py): Llama's structured names and
tensor-parallel mappings under `base_model_prefix` "qwen2", plus q/k/v biases (split with their
weights under TP)."""

PREFIX = "qwen2"
RULES = "hybridckpt.models.llama.dialects:paddlenlp.rules"
TP_RULES = "hybridckpt.models.llama.dialects:paddlenlp_tp.rules"
