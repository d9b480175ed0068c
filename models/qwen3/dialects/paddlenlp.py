"""PaddleNLP's Qwen3 (paddlenlp/transformers/qwen3/modeling.py): `base_model_prefix` "model", so
the structured names are HF's and only the layouts differ (Llama's rules and tensor-parallel
mappings); per-head q/k norms replicated on every rank; fused qkv with its bias and fused
gate_up optional."""

PREFIX = "model"
RULES = "hybridckpt.models.llama.dialects:paddlenlp.rules"
TP_RULES = "hybridckpt.models.llama.dialects:paddlenlp_tp.rules"
