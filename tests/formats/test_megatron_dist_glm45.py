"""GLM-4.5 from a Megatron-Bridge save's `run_config.yaml` (no Megatron-LM `args`): the `model:`
section Bridge's GLM45Bridge.provider_bridge fills (NVIDIA-NeMo/Megatron-Bridge
src/megatron/bridge/models/glm/glm45_bridge.py: sigmoid router with the expert bias, shared expert
of moe_intermediate_size, `moe_layer_freq` [0]*first_k_dense_replace + [1]*..., MTP layers,
qkv bias, q/k norm, partial rotary) reads as the GLM-4.5 config it came from; a field the
family cannot express is refused, not dropped. The Megatron-LM-args path is
tests/real/test_real_megatron_glm45.py (saves written by megatron-core itself)."""

from __future__ import annotations

import pytest

from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron.config import model_config
from hybridckpt.formats.megatron_dist.config import transformer_args
from hybridckpt.models.glm4_moe.config import Glm4MoeConfig


def bridge_model(**change) -> dict:
    """A GLM-4.5-Air-like `model:` section, as megatron-core's TransformerConfig /
    GPTModelProvider fields (tiny sizes)."""
    m = {
        "num_layers": 3, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 16, "normalization": "RMSNorm",
        "gated_linear_unit": True, "activation_func": {"_target_": "torch.nn.functional.silu"},
        "add_bias_linear": False, "add_qkv_bias": True, "qk_layernorm": False,
        "position_embedding_type": "rope", "rotary_base": 1000000.0, "rotary_percent": 0.5,
        "layernorm_epsilon": 1e-5, "share_embeddings_and_output_weights": False,
        "seq_length": 64, "vocab_size": 100, "num_moe_experts": 8, "moe_ffn_hidden_size": 16,
        "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_pre_softmax": False,
        "moe_router_topk_scaling_factor": 1.0, "moe_shared_expert_intermediate_size": 16,
        "moe_layer_freq": [0, 1, 1], "mtp_num_layers": 1, "moe_grouped_gemm": True,
    }  # fmt: skip
    m.update(change)
    return m


def test_bridge_glm45_model_section_gives_its_config():
    cfg = model_config(transformer_args(bridge_model(), 128, "run_config.yaml"), None, "run_config.yaml")
    assert isinstance(cfg, Glm4MoeConfig)
    got = {k: getattr(cfg, k) for k in (
        "vocab_size", "num_layers", "head_dim", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace", "attention_bias",
        "use_qk_norm", "partial_rotary_factor", "rope_theta", "num_nextn_predict_layers")}  # fmt: skip
    assert got == {
        "vocab_size": 100, "num_layers": 3, "head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "attention_bias": True, "use_qk_norm": False,
        "partial_rotary_factor": 0.5, "rope_theta": 1e6, "num_nextn_predict_layers": 1,
    }  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        # Qwen3-Next's / Qwen2-MoE's gated shared expert: GLM-4.5 has none (read, not dropped)
        (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate=True"),
        (dict(moe_shared_expert_intermediate_size=24), "no multiple of moe_ffn_hidden_size=16"),
        (dict(moe_router_enable_expert_bias=False), "expert_bias=False.*neither"),
    ],
)
def test_what_glm_cannot_express_is_refused(change, match):
    args = transformer_args(bridge_model(**change), 128, "run_config.yaml")
    with pytest.raises(FormatError, match=match):
        model_config(args, None, "run_config.yaml")


def test_partial_rope_of_a_family_without_it_is_refused():
    """A dense Llama-like Bridge model with `rotary_percent` 0.5: refused in one line."""
    m = {k: v for k, v in bridge_model().items() if not k.startswith(("moe_", "num_moe", "mtp"))}
    m.update(add_qkv_bias=False)
    with pytest.raises(FormatError, match=r"rotary_percent=0.5 \(partial RoPE\) is not supported for Llama"):
        model_config(transformer_args(m, 128, "run_config.yaml"), None, "run_config.yaml")
