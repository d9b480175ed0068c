"""The tiny models of the torchtitan cases, built with torchtitan 0.3.0's own config builders.

Each case is a `ModelSpec` (torchtitan's registry type: model config, parallelize function, HF
state-dict adapter, post-optimizer hook) built from the same private builders its registry uses
(`models/llama3/__init__.py` `_build_llama3_layers`, `models/qwen3/__init__.py`
`_build_qwen3_layers` / `_build_qwen3_moe_layers`), only smaller; beside it the HF `config.json`
(a dict) that describes the same model for HF/transformers, which is what a user passes to
hybridckpt's `--config` (torchtitan writes none into its checkpoints).

Imported only inside a rank, after `titan_shims.install()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VOCAB = 64
DIM = 32


def sdpa(cfg):
    """`cfg` with every layer's inner attention torchtitan's ScaledDotProductAttention (causal):
    flex_attention has no backward on CPU (see titan_shims.NOTES)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in [*cfg.layers, *getattr(cfg, "mtp_layers", [])]:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


@dataclass(frozen=True)
class Case:
    """One case: its torchtitan `spec` (ModelSpec), HF `hf_config` (config.json dict), the world
    size and parallelism degrees it runs with."""

    name: str
    spec: object
    hf_config: dict
    world: int
    parallelism: dict = field(default_factory=dict)
    moe: bool = False


def llama3() -> Case:
    """Llama 3 (ComplexRoPE with llama scaling, fused wqkv, untied head), FSDP over 2 ranks."""
    from torchtitan.models import llama3 as m
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.protocols.model_spec import ModelSpec

    heads, kv, hidden, layers = 4, 2, 48, 2
    rope = dict(theta=500000.0, scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=16)  # fmt: skip
    cfg = m.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._output_linear_init(DIM)),
        layers=m._build_llama3_layers(
            n_layers=layers, dim=DIM, n_heads=heads, n_kv_heads=kv, hidden_dim=hidden, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // heads, max_seq_len=64, scaling="llama", **rope),
            attn_backend="flex",
        ),
    )  # fmt: skip
    spec = ModelSpec(name="llama3", flavor="tiny", model=sdpa(cfg), parallelize_fn=m.parallelize_llama,
                     pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=m.Llama3StateDictAdapter)  # fmt: skip
    hf = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": DIM, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": DIM // heads,
        "max_position_embeddings": 64, "rms_norm_eps": cfg.norm.eps, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "rope_theta": rope["theta"],
        "rope_scaling": {"rope_type": "llama3", "factor": rope["scaling_factor"],
                         "low_freq_factor": rope["low_freq_factor"],
                         "high_freq_factor": rope["high_freq_factor"],
                         "original_max_position_embeddings": rope["original_max_position_embeddings"]},
    }  # fmt: skip
    return Case("torchtitan_llama3", spec, hf, world=2)


def _qwen3_spec(cfg, flavor: str):
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models import qwen3 as m
    from torchtitan.protocols.model_spec import ModelSpec

    return ModelSpec(name="qwen3", flavor=flavor, model=sdpa(cfg), parallelize_fn=m.parallelize_qwen3,
                     pipelining_fn=None, post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=m.Qwen3StateDictAdapter)  # fmt: skip


def qwen3() -> Case:
    """Qwen3 dense (CosSinRoPE, q/k norms, fused wqkv, TIED head as every small Qwen3 config of
    torchtitan has `enable_weight_tying=True`), FSDP over 2 ranks."""
    from torchtitan.models import qwen3 as m
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    heads, kv, head_dim, hidden, layers, theta = 4, 2, 8, 48, 2, 1e6
    cfg = m.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=m._qwen3_norm(DIM),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._LINEAR_INIT),
        layers=m._build_qwen3_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
            hidden_dim=hidden, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=theta),
        ),
    )  # fmt: skip
    hf = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
        "hidden_size": DIM, "intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "max_position_embeddings": 64, "rms_norm_eps": cfg.norm.eps, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "rope_theta": theta, "torch_dtype": "float32",
    }  # fmt: skip
    return Case("torchtitan_qwen3", _qwen3_spec(cfg, "tiny"), hf, world=2)


def qwen3_moe() -> Case:
    """Qwen3-MoE (every layer MoE: softmax router, route_norm, top-2 of 4 experts, load-balancing
    expert bias), 4 ranks: expert parallel 2 x FSDP 2 over the experts (efsdp), FSDP 4 elsewhere."""
    from torchtitan.models import qwen3 as m
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    heads, kv, head_dim, hidden, layers, experts, top_k, theta = 4, 2, 8, 16, 2, 4, 2, 1e6
    cfg = m.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=m._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._LINEAR_INIT),
        layers=m._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=heads, n_kv_heads=kv, head_dim=head_dim,
            moe_hidden_dim=hidden, num_experts=experts, top_k=top_k, attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=theta),
        ),
    )  # fmt: skip
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB,
        "hidden_size": DIM, "intermediate_size": 64, "moe_intermediate_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "num_experts": experts, "num_experts_per_tok": top_k,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 64, "rms_norm_eps": cfg.norm.eps, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "rope_theta": theta, "torch_dtype": "float32",
        "router_aux_loss_coef": 0.0, "output_router_logits": False,
    }  # fmt: skip
    return Case("torchtitan_qwen3_moe", _qwen3_spec(cfg, "tiny_moe"), hf, world=4,
                parallelism={"expert_parallel_degree": 2}, moe=True)  # fmt: skip


def deepseek_v3() -> Case:
    """DeepSeek V3 as torchtitan's 671B config shapes it, tiny: MLA with q LoRA, yarn RoPE (factor
    40 over 4096), one dense layer then one MoE layer (sigmoid router over 2 groups of 2 experts,
    1 group kept, top-2, route scale 2.5, route_norm, one shared expert, load-balancing bias) and
    one MTP layer; EP 2 x FSDP 2 over the experts on 4 ranks."""
    from torchtitan.models import deepseek_v3 as m
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    heads, q_lora, kv_lora, nope, rope_dim, v_dim = 4, 16, 16, 8, 8, 8
    dense_hidden, moe_hidden, experts, top_k, layers = 48, 16, 4, 2, 2
    layer_cfgs = m._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=DIM, n_heads=heads, q_lora_rank=q_lora,
        kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=v_dim,
        mscale=1.0, dense_hidden_dim=dense_hidden, moe_hidden_dim=moe_hidden, num_experts=experts,
        num_shared_experts=1, router_top_k=top_k, router_score_func="sigmoid",
        router_num_expert_groups=2, router_num_limited_groups=1, router_route_scale=2.5,
        router_route_norm=True, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096),
    )  # fmt: skip
    cfg = m.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=m._output_linear_init(DIM)),
        layers=layer_cfgs,
        mtp_layers=m._build_mtp_layers(layer_cfgs[-1], dim=DIM, num_mtp_layers=1),
    )  # fmt: skip
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.protocols.model_spec import ModelSpec

    spec = ModelSpec(name="deepseek_v3", flavor="tiny", model=sdpa(cfg),
                     parallelize_fn=m.parallelize_deepseekv3, pipelining_fn=None,
                     post_optimizer_build_fn=register_moe_load_balancing_hook,
                     state_dict_adapter=m.DeepSeekV3StateDictAdapter)  # fmt: skip
    hf = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": VOCAB,
        "hidden_size": DIM, "intermediate_size": dense_hidden, "moe_intermediate_size": moe_hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope_dim, "v_head_dim": v_dim, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": top_k, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
        "rms_norm_eps": cfg.norm.eps, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "rope_interleave": True, "torch_dtype": "float32",
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    }  # fmt: skip
    return Case("torchtitan_deepseek_v3", spec, hf, world=4,
                parallelism={"expert_parallel_degree": 2}, moe=True)  # fmt: skip


CASES = {"llama3": llama3, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
