"""optim/param_order.py: each family's declared `named_parameters()` order against transformers'
own modules (tiny configs, built on the meta device: no weights), and the HF Trainer's
decay / no-decay split of those names against `Trainer.get_decay_parameter_names`."""

from __future__ import annotations

import random

import pytest

from hybridckpt import models, naming
from hybridckpt.errors import MappingError
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.deepseek_v32.config import DeepseekV32Config
from hybridckpt.models.gemma2.config import Gemma2Config
from hybridckpt.models.gemma3.config import Gemma3Config
from hybridckpt.models.gemma3_mm.config import Gemma3MMConfig
from hybridckpt.models.gpt2.config import GPT2Config
from hybridckpt.models.gpt_oss.config import GptOssConfig
from hybridckpt.models.granite.config import GraniteConfig
from hybridckpt.models.llama.config import LlamaConfig
from hybridckpt.models.mistral.config import MistralConfig
from hybridckpt.models.mixtral.config import MixtralConfig
from hybridckpt.models.olmo2.config import Olmo2Config
from hybridckpt.models.phi3.config import Phi3Config
from hybridckpt.models.qwen2.config import Qwen2Config
from hybridckpt.models.qwen3.config import Qwen3Config
from hybridckpt.models.qwen3_moe.config import Qwen3MoeConfig
from hybridckpt.optim import param_order
from hybridckpt.optim.trainer_groups import trainer_groups

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_L = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
          max_position_embeddings=64)  # fmt: skip
_G = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
          head_dim=8, sliding_window=3)  # fmt: skip
_MOE = dict(_L, num_layers=4, num_experts=4, moe_intermediate_size=16)
_DS = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_layers=4,
           num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
           n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
_MM = dict(_G, vision_hidden_size=16, vision_intermediate_size=24, vision_num_layers=2, vision_image_size=8,
           vision_patch_size=4, text_prefix="model.language_model.", vision_prefix="model.vision_tower.",
           projector_prefix="model.multi_modal_projector.", head_name="lm_head.weight")  # fmt: skip

# every family; biases, tied heads, dense and sparse layers, the q LoRA: what changes the names
VARIANTS = {
    "llama": LlamaConfig(**_L),
    "llama_tied": LlamaConfig(**_L, tie_word_embeddings=True),
    "mistral": MistralConfig(**_L, sliding_window=3),
    "granite": GraniteConfig(**_L, embedding_multiplier=12.0, logits_scaling=8.0),
    "qwen2_tied": Qwen2Config(**_L, tie_word_embeddings=True),
    "qwen3_bias": Qwen3Config(**_L, attention_bias=True),
    "olmo2": Olmo2Config(**_L),
    "phi3": Phi3Config(**_L),
    "gemma2": Gemma2Config(**_G),
    "gemma3_untied": Gemma3Config(**_G, tie_word_embeddings=False),
    "gemma3_mm_head": Gemma3MMConfig(**_MM, vision_use_head=True),
    "gpt2": GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "mixtral": MixtralConfig(**_L, num_experts=4),
    "qwen3_moe_dense_layer": Qwen3MoeConfig(**_MOE, mlp_only_layers=(0,)),
    "deepseek_v3_lora_bias": DeepseekV3Config(**_DS, q_lora_rank=24, attention_bias=True, first_k_dense_replace=2),
    "deepseek_v3_no_lora": DeepseekV3Config(**{**_DS, "num_layers": 3}, first_k_dense_replace=1),
    "deepseek_v32_bias": DeepseekV32Config(**_DS, q_lora_rank=24, attention_bias=True, first_k_dense_replace=1,
                                           index_topk=2, index_head_dim=12, index_n_heads=4),
    "gpt_oss": GptOssConfig(**_L, head_dim=12, num_experts=4, num_experts_per_tok=2, sliding_window=3),
}  # fmt: skip
# transformers 5 holds these MoE experts fused in memory (`mlp.experts.gate_up_proj`), under other
# names than the Hub's per-expert files the table reads
FUSED_IN_MEMORY = {"mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v32"}


def _hf_model(cfg):
    hf = models.config_to_hf(cfg)
    hf["pad_token_id"] = None  # (the tiny vocabularies hold no Phi-3 pad id 32000)
    if cfg.family == "gemma3_mm":  # (its config.json's vision part travels as `hf_rest`)
        hf |= {"mm_tokens_per_image": 4, "vision_config": {
            "hidden_size": cfg.vision_hidden_size, "intermediate_size": cfg.vision_intermediate_size,
            "num_hidden_layers": cfg.vision_num_layers, "num_attention_heads": 2, "image_size": cfg.vision_image_size,
            "patch_size": cfg.vision_patch_size, "vision_use_head": cfg.vision_use_head}}  # fmt: skip
    cls = getattr(transformers, hf["architectures"][0])
    with torch.device("meta"):
        return cls(cls.config_class(**hf))


def test_the_variants_cover_every_family():
    assert {cfg.family for cfg in VARIANTS.values()} == set(models.families())


@pytest.mark.parametrize("name", VARIANTS)
def test_named_parameters_order_is_transformers(name):
    cfg = VARIANTS[name]
    model = _hf_model(cfg)
    theirs = [n for n, _ in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if cfg.family not in FUSED_IN_MEMORY:  # the table's HF names are the module's names
        assert naming.model_hf_shapes(cfg) == shapes
    else:  # the live (fused) names and shapes, read back from the Hub's by the family's name fixes
        from hybridckpt.jobs.index_optimizer import _live_names

        live = _live_names(cfg, naming.model_hf_shapes(cfg))[0]
        # (DeepSeek V3's router bias is a param of the table but a buffer of transformers' module:
        # not in named_parameters(), so an index-keyed DeepSeek state is refused, not guessed)
        assert {k: v for k, v in live.items() if not k.endswith(".e_score_correction_bias")} == shapes
    shuffled = list(theirs)
    random.Random(0).shuffle(shuffled)
    assert shuffled != theirs
    got = param_order.named_parameters(cfg, shuffled)
    assert list(got.names) == theirs
    layernorms = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
                  for p, _ in mod.named_parameters(recurse=False)}  # fmt: skip
    assert got.layernorms == layernorms
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    g0, g1 = trainer_groups(got.names, got.layernorms)
    assert (g0, g1) == ([n for n in theirs if n in decay], [n for n in theirs if n not in decay])
    assert g0 and g1


def test_a_name_the_family_does_not_declare_is_refused():
    cfg = VARIANTS["llama"]
    names = [*naming.model_hf_shapes(cfg), "model.layers.0.self_attn.rotary_emb.extra"]
    with pytest.raises(MappingError, match=r"llama's named_parameters\(\) order .* does not place \['model.layers.0"):
        param_order.named_parameters(cfg, names)
