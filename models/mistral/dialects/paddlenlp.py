"""PaddleNLP's Mistral (paddlenlp/transformers/mistral/modeling.py): Llama's structured names and
tensor-parallel mappings under `base_model_prefix` "mistral"; never tied (`MistralLMHead` is
always its own `[hidden, vocab]`)."""

PREFIX = "mistral"
RULES = "hybridckpt.models.llama.dialects:paddlenlp.rules"
TP_RULES = "hybridckpt.models.llama.dialects:paddlenlp_tp.rules"
