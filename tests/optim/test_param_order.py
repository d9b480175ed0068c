"""optim/param_order.py: each family's declared `named_parameters()` order against transformers'
own modules (tiny configs, built on the meta device: no weights), and the HF Trainer's
decay / no-decay split of those names against `Trainer.get_decay_parameter_names`."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from hybridckpt import models, naming
from hybridckpt.errors import MappingError
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.deepseek_v32.config import DeepseekV32Config
from hybridckpt.models.ernie4_5.config import Ernie45Config
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig
from hybridckpt.models.gemma2.config import Gemma2Config
from hybridckpt.models.gemma3.config import Gemma3Config
from hybridckpt.models.gemma3_mm.config import Gemma3MMConfig
from hybridckpt.models.glm4_moe.config import Glm4MoeConfig
from hybridckpt.models.gpt2.config import GPT2Config
from hybridckpt.models.gpt_oss.config import GptOssConfig
from hybridckpt.models.granite.config import GraniteConfig
from hybridckpt.models.llama.config import LlamaConfig
from hybridckpt.models.llama4.config import Llama4Config
from hybridckpt.models.llama4_mm.config import Llama4MMConfig
from hybridckpt.models.mistral.config import MistralConfig
from hybridckpt.models.mistral3.config import Mistral3Config
from hybridckpt.models.mixtral.config import MixtralConfig
from hybridckpt.models.olmo2.config import Olmo2Config
from hybridckpt.models.phi3.config import Phi3Config
from hybridckpt.models.qwen2.config import Qwen2Config
from hybridckpt.models.qwen2_moe.config import Qwen2MoeConfig
from hybridckpt.models.qwen3.config import Qwen3Config
from hybridckpt.models.qwen3_moe.config import Qwen3MoeConfig
from hybridckpt.models.qwen3_next.config import Qwen3NextConfig
from hybridckpt.models.smollm3.config import SmolLM3Config
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
_GLM = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_layers=4, num_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
_ERNIE_MOE = dict(_L, num_layers=3, moe_num_experts=4, moe_k=2, moe_intermediate_size=16)
_PIXTRAL = dict(vision_hidden_size=8, vision_intermediate_size=16, vision_num_layers=2, vision_patch_size=4)
_MODULE_NAMES = dict(text_prefix="model.language_model.", vision_prefix="model.vision_tower.",
                     projector_prefix="model.multi_modal_projector.", head_name="lm_head.weight")  # fmt: skip
_NEXT = dict(_L, num_layers=3, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             shared_expert_intermediate_size=12, linear_conv_kernel_dim=3, linear_key_head_dim=4,
             linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
_VL_TEXT = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                    "mrope_section": [2, 1, 1]})  # fmt: skip
_VL_VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, out_hidden_size=32)
# the prefixes a live wrapper holds its parts by (transformers 5's save writes others too: `_released`)
_LIVE_PREFIXES = dict(text_prefix="model.language_model.", vision_prefix="model.visual.")


def _vl(arch: str, model_type: str, vision: dict, **top):
    """A Qwen-VL wrapper's config as read from its config.json (the tower's sizes travel in it),
    under the live prefixes."""
    d = {"architectures": [arch], "model_type": model_type, "text_config": _VL_TEXT, "vision_config": vision, **top}
    return dataclasses.replace(models.config_from_hf(d), **_LIVE_PREFIXES)


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
    "smollm3_untied": SmolLM3Config(**_L, tie_word_embeddings=False, no_rope_layers=(0, 1)),
    "ernie4_5_bias_tied": Ernie45Config(**_L, use_bias=True, tie_word_embeddings=True, head_dim=12),
    "ernie4_5_untied": Ernie45Config(**_L),
    # the MTP module (transformers builds none) and the frozen router bias: see the refusals below
    "ernie4_5_moe_dense_shared_bias_mtp": Ernie45MoeConfig(**_ERNIE_MOE, use_bias=True, moe_num_shared_experts=2,
                                                           moe_layer_start_index=1, num_nextn_predict_layers=1),
    "ernie4_5_moe_all_moe_untied": Ernie45MoeConfig(**_ERNIE_MOE, tie_word_embeddings=False, moe_num_shared_experts=0,
                                                    moe_layer_start_index=0),
    "qwen2_moe_dense_layer_bias": Qwen2MoeConfig(**_MOE, mlp_only_layers=(0,), shared_expert_intermediate_size=24),
    "qwen2_moe_no_bias_tied": Qwen2MoeConfig(**_MOE, qkv_bias=False, decoder_sparse_step=2, tie_word_embeddings=True),
    "glm4_moe_dense_qk_norm_bias_mtp": Glm4MoeConfig(**_GLM, num_kv_heads=2, use_qk_norm=True, attention_bias=True,
                                                     first_k_dense_replace=2, num_nextn_predict_layers=1),
    "glm4_moe_all_moe_tied": Glm4MoeConfig(**{**_GLM, "num_layers": 2}, num_kv_heads=4, tie_word_embeddings=True,
                                           first_k_dense_replace=0),
    "llama4_interleaved": Llama4Config(**{**_L, "num_layers": 4}, head_dim=8, num_experts=4, intermediate_size_mlp=40,
                                       interleave_moe_layer_step=2),
    "llama4_all_moe_tied": Llama4Config(**_L, num_experts=2, tie_word_embeddings=True),
    "llama4_mm": Llama4MMConfig(**_L, num_experts=2, moe_layers=(1,), vision_hidden_size=16, vision_intermediate_size=64,
                                vision_num_layers=2, vision_image_size=8, vision_patch_size=4, vision_output_dim=24,
                                projector_input_dim=24, projector_output_dim=24),
    "mistral3_tied": Mistral3Config(**_L, head_dim=12, **_PIXTRAL, **_MODULE_NAMES),
    "mistral3_untied_bias": Mistral3Config(**_L, tie_word_embeddings=False, **_PIXTRAL, num_feature_layers=2,
                                           projector_bias=True, **_MODULE_NAMES),
    "qwen3_vl_deepstack": _vl("Qwen3VLForConditionalGeneration", "qwen3_vl", dict(
        _VL_VISION, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1])),
    "qwen3_vl_tied": _vl("Qwen3VLForConditionalGeneration", "qwen3_vl", dict(
        _VL_VISION, num_position_embeddings=16, deepstack_visual_indexes=[1]), tie_word_embeddings=True),
    "qwen2_5_vl": _vl("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", dict(
        _VL_VISION, fullatt_block_indexes=[1], window_size=8)),
    "qwen3_next_dense_layer": Qwen3NextConfig(**_NEXT, mlp_only_layers=(1,), layer_types=(
        "linear_attention", "full_attention", "linear_attention")),
    "qwen3_next_tied": Qwen3NextConfig(**{**_NEXT, "num_layers": 2}, tie_word_embeddings=True, layer_types=(
        "full_attention", "linear_attention")),
}  # fmt: skip
# transformers 5 holds these MoE experts fused in memory (`mlp.experts.gate_up_proj`), under other
# names than the Hub's per-expert files the table reads
FUSED_IN_MEMORY = {"mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "glm4_moe", "ernie4_5_moe", "qwen3_next", "deepseek_v32"}
# a router bias transformers holds as a buffer (DeepSeek V3, GLM-4.5) or as a frozen parameter
# (ERNIE 4.5's `moe_statics`): the declarations leave it out, so a state naming it is refused
ROUTER_BIAS = "e_score_correction_bias"


def _hf_model(cfg):
    hf = models.config_to_hf(cfg)
    hf["pad_token_id"] = None  # (the tiny vocabularies hold no Phi-3 pad id 32000)
    if cfg.family == "gemma3_mm":  # (its config.json's vision part travels as `hf_rest`)
        hf |= {"mm_tokens_per_image": 4, "vision_config": {
            "hidden_size": cfg.vision_hidden_size, "intermediate_size": cfg.vision_intermediate_size,
            "num_hidden_layers": cfg.vision_num_layers, "num_attention_heads": 2, "image_size": cfg.vision_image_size,
            "patch_size": cfg.vision_patch_size, "vision_use_head": cfg.vision_use_head}}  # fmt: skip
    if cfg.family == "mistral3":
        hf |= {"vision_feature_layer": [-1, -2][:cfg.num_feature_layers], "multimodal_projector_bias": cfg.projector_bias,
               "vision_config": {"model_type": "pixtral", "hidden_size": cfg.vision_hidden_size, "num_attention_heads": 2,
                                 "intermediate_size": cfg.vision_intermediate_size, "image_size": 16,
                                 "num_hidden_layers": cfg.vision_num_layers, "patch_size": cfg.vision_patch_size}}  # fmt: skip
    if cfg.family == "llama4_mm":
        hf |= {"vision_config": {
            "hidden_size": cfg.vision_hidden_size, "intermediate_size": cfg.vision_intermediate_size,
            "num_hidden_layers": cfg.vision_num_layers, "num_attention_heads": 2, "image_size": cfg.vision_image_size,
            "patch_size": cfg.vision_patch_size, "vision_output_dim": cfg.vision_output_dim,
            "projector_input_dim": cfg.projector_input_dim, "projector_output_dim": cfg.projector_output_dim}}  # fmt: skip
    cls = getattr(transformers, hf["architectures"][0])
    with torch.device("meta"):
        return cls(cls.config_class(**hf))


def test_the_variants_cover_every_family():
    assert {cfg.family for cfg in VARIANTS.values()} == set(models.families())


@pytest.mark.parametrize("name", VARIANTS)
def test_named_parameters_order_is_transformers(name):
    cfg = VARIANTS[name]
    model = _hf_model(cfg)
    # (ERNIE 4.5's frozen router bias is left out of the declaration: `test_..._refused` below)
    trainable = {n: p for n, p in model.named_parameters() if not n.endswith(ROUTER_BIAS)}
    assert all(p.requires_grad for p in trainable.values())
    theirs = list(trainable)
    shapes = {n: tuple(p.shape) for n, p in trainable.items()}
    # the params transformers builds: no MTP module (`fit_to_hf_names` finds none among its names)
    hub = naming.model_hf_shapes(models.fit_to_hf_names(cfg, theirs))
    if cfg.family not in FUSED_IN_MEMORY:  # the table's HF names are the module's names
        assert hub == shapes
    else:  # the live (fused) names and shapes, read back from the Hub's by the family's name fixes
        from hybridckpt.formats.index_naming import _live_names

        live = _live_names(cfg, hub)[0]
        # (DeepSeek V3's and GLM-4.5's router bias is a param of the table but a buffer of
        # transformers' module: not in named_parameters(), so an index-keyed state is refused)
        assert {k: v for k, v in live.items() if not k.endswith(ROUTER_BIAS)} == shapes
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


@pytest.mark.parametrize("name", ["deepseek_v3_no_lora", "glm4_moe_all_moe_tied", "ernie4_5_moe_all_moe_untied"])
def test_a_router_bias_transformers_does_not_train_is_refused(name):
    """DeepSeek V3's and GLM-4.5's `e_score_correction_bias` is a buffer of transformers' module
    (no optimizer index), ERNIE 4.5's a frozen parameter (`requires_grad=False`: the Trainer
    leaves it out, `AdamW(model.parameters())` puts it in): no rule numbers the params around
    it, so names holding it (as the checkpoint's live names or the Hub's) are refused."""
    from hybridckpt.formats.index_naming import _live_names

    cfg = VARIANTS[name]
    model = _hf_model(cfg)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert [n.endswith(ROUTER_BIAS) for n in frozen] == [True] * len(frozen)
    assert bool(frozen) == (cfg.family == "ernie4_5_moe")
    live = list(_live_names(cfg, naming.model_hf_shapes(cfg))[0])
    assert [n for n in live if n.endswith(ROUTER_BIAS)]
    for names in (live, [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n.endswith(ROUTER_BIAS)]):
        with pytest.raises(MappingError, match=rf"{cfg.family}'s named_parameters\(\) order .* does not place "
                                               rf"\['model\.layers\.\d+\.mlp\.\S*{ROUTER_BIAS}'"):
            param_order.named_parameters(cfg, names)
    param_order.named_parameters(cfg, [n for n in live if not n.endswith(ROUTER_BIAS)])  # the rest is placed


@pytest.mark.parametrize(("name", "mtp"), [("glm4_moe_dense_qk_norm_bias_mtp", "model.layers.4."),
                                           ("ernie4_5_moe_dense_shared_bias_mtp", "model.mtp_")])
def test_the_mtp_modules_transformers_does_not_build_are_refused(name, mtp):
    """A checkpoint holding the MTP modules (GLM-4.5's `model.layers.{L}`, ERNIE's `model.mtp_*`)
    has params transformers' module does not build: its optimizer's indices are not theirs,
    refused (the variant's test above orders the same config's names without them)."""
    from hybridckpt.formats.index_naming import _live_names

    cfg = VARIANTS[name]
    hub = naming.model_hf_shapes(cfg)
    assert cfg.mtp_layers == 1 and any(n.startswith(mtp) for n in hub)
    live = [n for n in _live_names(cfg, hub)[0] if not n.endswith(ROUTER_BIAS)]
    with pytest.raises(MappingError, match=rf"{cfg.family}'s named_parameters\(\) order .* does not place "
                                           rf"\[{re.escape(repr(mtp))[:-1]}"):
        param_order.named_parameters(cfg, live)


@pytest.mark.parametrize("name", ["mistral3_untied_bias", "gemma3_mm_head"])
def test_the_hubs_prefixes_sort_as_the_modules_names(name):
    """A wrapper's checkpoint under the Hub's prefixes (`language_model.model.*`, `vision_tower.*`,
    `language_model.lm_head.weight`, what `save_pretrained` writes by default) is ordered as
    transformers' module holds it under its own (`model.language_model.*`, ...): the declared
    order is written with the prefixes, filled from the config."""
    import dataclasses
    import importlib

    module = VARIANTS[name]
    prefixes = importlib.import_module(type(module).__module__)  # the family's config: its spellings
    hub = dataclasses.replace(module, text_prefix=prefixes.TEXT_PREFIXES[0], vision_prefix=prefixes.VISION_PREFIXES[0],
                              projector_prefix=prefixes.PROJECTOR_PREFIXES[0], head_name=prefixes.HEAD_NAMES[0])
    to_module = {getattr(hub, f): getattr(module, f) for f in ("head_name", "text_prefix", "vision_prefix", "projector_prefix")}

    def renamed(n: str) -> str:
        for a, b in to_module.items():
            if n.startswith(a):
                return b + n[len(a):]
        raise AssertionError(n)

    names = list(naming.model_hf_shapes(hub))
    assert names[0].startswith("language_model.model.")
    random.Random(1).shuffle(names)
    got = param_order.named_parameters(hub, names)
    theirs = [n for n, _ in _hf_model(module).named_parameters()]
    assert [renamed(n) for n in got.names] == theirs
    assert {renamed(n) for n in got.layernorms} == param_order.named_parameters(module, theirs).layernorms
