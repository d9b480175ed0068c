"""models/table.py: each family's params are declared once, in its table; the Flax module creates
exactly the table's params (shapes AND logical axes) for every family and config variant, the
generated HF rules map every HF tensor onto the tree and back, and a family defined by a table
alone (no Flax module at all) imports, exports and plans."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from hybridckpt import models, naming
from hybridckpt.models.common import axes_of, unboxed
from hybridckpt.models.deepseek_v3.config import DeepseekV3Config
from hybridckpt.models.deepseek_v32.config import DeepseekV32Config
from hybridckpt.models.ernie4_5.config import Ernie45Config
from hybridckpt.models.ernie4_5_moe.config import Ernie45MoeConfig
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.family import _discover
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
from hybridckpt.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from hybridckpt.models.qwen2_moe.config import Qwen2MoeConfig
from hybridckpt.models.qwen3.config import Qwen3Config
from hybridckpt.models.qwen3_moe.config import Qwen3MoeConfig
from hybridckpt.models.qwen3_next.config import Qwen3NextConfig
from hybridckpt.models.qwen3_vl.config import Qwen3VLConfig
from hybridckpt.models.smollm3.config import SmolLM3Config
from hybridckpt.models.table import Drop, Param, ParamTable, stack

_LLAMA = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, max_position_embeddings=64)  # fmt: skip
_GEMMA = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, sliding_window=3)  # fmt: skip
_MOE = dict(_LLAMA, num_layers=4, num_experts=4, moe_intermediate_size=16)
_DS = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_layers=3, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
_GLM = dict(vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_layers=3,
            num_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip

# every family, and each option that changes its tree: tied / untied heads, head_dim apart from
# hidden / heads, biases, q/k norms, sliding windows, MoE with and without dense layers, MTP
VARIANTS = {
    "llama": LlamaConfig(**_LLAMA),
    "llama_tied": LlamaConfig(**_LLAMA, tie_word_embeddings=True),
    "llama_mqa_head_dim": LlamaConfig(**{**_LLAMA, "num_kv_heads": 1}, head_dim=10),
    "mistral_window": MistralConfig(**_LLAMA, sliding_window=3),
    "qwen2": Qwen2Config(**_LLAMA),
    "qwen2_tied": Qwen2Config(**_LLAMA, tie_word_embeddings=True),
    "qwen3_head_dim": Qwen3Config(**_LLAMA, head_dim=12),
    "qwen3_bias_tied": Qwen3Config(**_LLAMA, attention_bias=True, tie_word_embeddings=True),
    "gemma2": Gemma2Config(**_GEMMA),
    "gemma2_untied": Gemma2Config(**_GEMMA, tie_word_embeddings=False),
    "gemma3": Gemma3Config(**_GEMMA, final_logit_softcapping=20.0),
    "gemma3_untied": Gemma3Config(**_GEMMA, tie_word_embeddings=False),
    "gpt2": GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4),
    "gpt2_inner": GPT2Config(vocab_size=30, n_positions=5, n_embd=24, n_layer=1, n_head=3, n_inner=40),
    "mixtral": MixtralConfig(**_LLAMA, num_experts=4),
    "mixtral_tied_window": MixtralConfig(**_LLAMA, num_experts=4, tie_word_embeddings=True, sliding_window=3),
    "qwen3_moe": Qwen3MoeConfig(**{**_MOE, "num_layers": 2}),
    "qwen3_moe_dense_layer": Qwen3MoeConfig(**_MOE, mlp_only_layers=(0,)),
    "qwen3_moe_sparse_step_tied": Qwen3MoeConfig(**_MOE, decoder_sparse_step=2, tie_word_embeddings=True),
    "deepseek_v3": DeepseekV3Config(**_DS, first_k_dense_replace=1),
    "deepseek_v3_lora_bias_mtp2": DeepseekV3Config(**{**_DS, "num_layers": 4}, q_lora_rank=24,
                                                   attention_bias=True, first_k_dense_replace=2,
                                                   num_nextn_predict_layers=2),
    "deepseek_v3_all_moe_tied_mtp": DeepseekV3Config(**_DS, tie_word_embeddings=True, num_nextn_predict_layers=1),
    "deepseek_v3_lora_no_bias": DeepseekV3Config(**_DS, q_lora_rank=24, first_k_dense_replace=1),
    "deepseek_v3_all_dense": DeepseekV3Config(**_DS, first_k_dense_replace=3),
    "deepseek_v32_bias_mtp": DeepseekV32Config(**_DS, q_lora_rank=24, first_k_dense_replace=1, attention_bias=True,
                                               num_nextn_predict_layers=1, index_topk=2, index_head_dim=12,
                                               index_n_heads=4),
    "gpt_oss": GptOssConfig(**_LLAMA, head_dim=12, num_experts=4, num_experts_per_tok=2, sliding_window=3),
    "gpt_oss_no_bias_tied_full": GptOssConfig(**{**_LLAMA, "num_layers": 3}, num_experts=2, num_experts_per_tok=1,
                                              attention_bias=False, tie_word_embeddings=True,
                                              layer_types=("full_attention",) * 3),
    "olmo2": Olmo2Config(**_LLAMA),
    "olmo2_tied_head_dim": Olmo2Config(**_LLAMA, tie_word_embeddings=True, head_dim=12),
    "granite": GraniteConfig(**_LLAMA, embedding_multiplier=12.0, logits_scaling=8.0),
    "granite_tied": GraniteConfig(**_LLAMA, tie_word_embeddings=True),
    "gemma3_mm": Gemma3MMConfig(**_GEMMA, vision_hidden_size=16, vision_intermediate_size=24, vision_num_layers=2,
                                vision_image_size=8, vision_patch_size=4),
    "gemma3_mm_untied_pool_head_module_names": Gemma3MMConfig(
        **_GEMMA, tie_word_embeddings=False, vision_hidden_size=16, vision_intermediate_size=24, vision_num_layers=1,
        vision_image_size=8, vision_patch_size=2, vision_use_head=True, text_prefix="model.language_model.",
        vision_prefix="model.vision_tower.", projector_prefix="model.multi_modal_projector.", head_name="lm_head.weight"),
    "phi3": Phi3Config(**_LLAMA),
    "phi3_tied_partial_longrope_window": Phi3Config(**_LLAMA, tie_word_embeddings=True, partial_rotary_factor=0.5,
                                                    longrope={"short_factor": [1, 2], "long_factor": [3, 4]},
                                                    sliding_window=3),
    "qwen2_moe": Qwen2MoeConfig(**{**_MOE, "num_layers": 2}, shared_expert_intermediate_size=24),
    "qwen2_moe_dense_no_bias_tied": Qwen2MoeConfig(**_MOE, mlp_only_layers=(0,), decoder_sparse_step=2, qkv_bias=False,
                                                   tie_word_embeddings=True),
    "mistral3": Mistral3Config(**_LLAMA, head_dim=12, vision_hidden_size=8, vision_intermediate_size=16,
                               vision_num_layers=2, vision_patch_size=4),
    "mistral3_untied_bias_module_names": Mistral3Config(
        **_LLAMA, tie_word_embeddings=False, vision_hidden_size=8, vision_intermediate_size=16, vision_num_layers=1,
        vision_patch_size=2, num_feature_layers=2, projector_bias=True, text_prefix="model.language_model.",
        vision_prefix="model.vision_tower.", projector_prefix="model.multi_modal_projector.", head_name="lm_head.weight"),
    "smollm3": SmolLM3Config(**{**_LLAMA, "num_layers": 4}),
    "smollm3_untied_head_dim_list": SmolLM3Config(**_LLAMA, tie_word_embeddings=False, head_dim=12,
                                                  no_rope_layers=(0, 1)),
    "glm4_moe_qk_norm_bias_mtp": Glm4MoeConfig(**{**_GLM, "num_layers": 4}, num_kv_heads=2, use_qk_norm=True,
                                               attention_bias=True, first_k_dense_replace=2, num_nextn_predict_layers=1),
    "glm4_moe_air_tied_all_moe": Glm4MoeConfig(**_GLM, num_kv_heads=4, head_dim=12, tie_word_embeddings=True,
                                               first_k_dense_replace=0, partial_rotary_factor=1.0),
    "ernie4_5_bias_tied": Ernie45Config(**_LLAMA, use_bias=True, tie_word_embeddings=True, head_dim=12),
    "ernie4_5_untied": Ernie45Config(**_LLAMA),
    "ernie4_5_moe_bias_tied_shared_mtp": Ernie45MoeConfig(**{**_LLAMA, "num_layers": 4}, use_bias=True, tie_word_embeddings=True,
                                                      moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                                      moe_num_shared_experts=2, moe_layer_start_index=1,
                                                      num_nextn_predict_layers=1),
    "ernie4_5_moe_all_moe_no_shared": Ernie45MoeConfig(**_LLAMA, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                                                       moe_num_shared_experts=0, moe_layer_start_index=0),
    "llama4_interleaved": Llama4Config(**{**_LLAMA, "num_layers": 4}, head_dim=8, num_experts=4, intermediate_size_mlp=40,
                                       interleave_moe_layer_step=2, attention_chunk_size=4),
    "llama4_all_moe_tied": Llama4Config(**_LLAMA, num_experts=2, tie_word_embeddings=True),
    "llama4_all_dense": Llama4Config(**_LLAMA, num_experts=2, moe_layers=()),
    "llama4_mm_tied": Llama4MMConfig(**_LLAMA, num_experts=2, moe_layers=(1,), tie_word_embeddings=True, vision_hidden_size=16,
                                vision_intermediate_size=64, vision_num_layers=2, vision_image_size=8,
                                vision_patch_size=4, vision_output_dim=24, projector_input_dim=24,
                                projector_output_dim=24),
    "qwen3_vl": Qwen3VLConfig(**_LLAMA, mrope_section=(2, 1, 1), vision_depth=2, vision_hidden_size=16,
                              vision_intermediate_size=24, vision_patch_size=4, vision_out_hidden_size=32,
                              vision_num_position_embeddings=16, vision_deepstack_layers=(0, 1)),
    "qwen3_vl_tied_legacy_names_no_deepstack": Qwen3VLConfig(
        **_LLAMA, tie_word_embeddings=True, mrope_section=(2, 1, 1), vision_depth=1, vision_hidden_size=8,
        vision_intermediate_size=12, vision_patch_size=2, vision_out_hidden_size=32, vision_num_position_embeddings=4,
        vision_deepstack_layers=(), text_prefix="model.", vision_prefix="visual."),
    "qwen3_next": Qwen3NextConfig(**{**_MOE, "num_layers": 4}, head_dim=8, shared_expert_intermediate_size=12,
                                  linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
                                  linear_num_key_heads=2, linear_num_value_heads=4, partial_rotary_factor=0.5,
                                  layer_types=("linear_attention",) * 3 + ("full_attention",)),
    "qwen3_next_dense_layer_tied": Qwen3NextConfig(
        **{**_MOE, "num_layers": 2}, mlp_only_layers=(1,), tie_word_embeddings=True, shared_expert_intermediate_size=8,
        linear_conv_kernel_dim=2, linear_key_head_dim=4, linear_value_head_dim=4, linear_num_key_heads=1,
        linear_num_value_heads=1, layer_types=("full_attention", "linear_attention")),
    "qwen2_5_vl": Qwen2_5_VLConfig(**_LLAMA, mrope_section=(1, 1, 2), vision_depth=2, vision_hidden_size=16,
                                   vision_intermediate_size=24, vision_patch_size=4, vision_out_hidden_size=32),
    "qwen2_5_vl_tied_module_names": Qwen2_5_VLConfig(
        **_LLAMA, tie_word_embeddings=True, mrope_section=(1, 1, 2), vision_depth=1, vision_hidden_size=8,
        vision_intermediate_size=12, vision_patch_size=2, vision_out_hidden_size=32,
        text_prefix="model.language_model.", vision_prefix="model.visual."),
}  # fmt: skip


def flax_init(cfg) -> tuple[dict, dict]:
    """(shapes, logical axes) of the params the family's Flax module creates at init (traced)."""
    boxed = jax.eval_shape(lambda: models.module(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    return jax.tree.map(lambda s: tuple(s.shape), unboxed(boxed)), axes_of(boxed)


def test_the_variants_cover_every_family():
    assert {cfg.family for cfg in VARIANTS.values()} == set(models.families())


@pytest.mark.parametrize("name", VARIANTS)
def test_the_flax_init_creates_exactly_the_tables_params(name):
    cfg = VARIANTS[name]
    shapes, axes = flax_init(cfg)
    assert shapes == models.param_shape_tree(cfg)
    assert axes == models.param_axes_tree(cfg)


def _with_rows(monkeypatch, family: str, rows) -> None:
    """The family `family` with its table's rows replaced (what the registry gives, this test)."""
    fam = _discover()[family]
    table = dataclasses.replace(fam.table, rows=tuple(rows))
    monkeypatch.setitem(_discover(), family, dataclasses.replace(fam, table=table))


def test_a_table_the_module_does_not_build_is_seen(monkeypatch):
    """What the equality above checks can fail: a row the module never creates, a leading axis
    the layer scan does not give, and a param the module creates without a row."""
    cfg = VARIANTS["llama"]
    rows = models.family_of(cfg).table.rows
    extra = Param("layers.extra.kernel", ("L", "E", "E"), ("layers", "embed", None), "model.extra")
    _with_rows(monkeypatch, "llama", (*rows, extra))
    assert flax_init(cfg)[0] != models.param_shape_tree(cfg)
    unscanned = [dataclasses.replace(r, axes=(None, *r.axes[1:])) if getattr(r, "path", "") == "layers.q.kernel" else r
                 for r in rows]
    _with_rows(monkeypatch, "llama", unscanned)
    assert flax_init(cfg)[1] != models.param_axes_tree(cfg)
    _with_rows(monkeypatch, "llama", [r for r in rows if getattr(r, "path", "") != "layers.k.kernel"])
    with pytest.raises(ConfigError, match="models/llama/params.py: the module creates 'layers.k.kernel'"):
        flax_init(cfg)


@pytest.mark.parametrize("name", VARIANTS)
def test_the_generated_rules_map_the_hf_tensors_onto_the_tree_and_back(name):
    """The inverse of the generated rules gives every HF name once (the tied head and buffers
    none); the rules take them back onto exactly the table's params and shapes."""
    cfg = VARIANTS[name]
    hf = naming.model_hf_shapes(cfg)
    placeholders = {k: naming._placeholder(s) for k, s in hf.items()}
    tree = naming.hf_to_tree(naming.Named(placeholders), cfg).params  # checks names and shapes
    assert {k: tuple(t.shape) for k, t in tree.items()} == naming.flatten(models.param_shape_tree(cfg))
    assert ("lm_head.weight" in hf) == (not models.rule_variables(cfg)["tied"])


def test_the_rules_text_is_one_line_per_row():
    text, origin = models.hf_rules(VARIANTS["qwen3_moe"])
    assert origin == "models/qwen3_moe/params.py table"
    lines = text.splitlines()
    assert len(lines) == len(models.family_of(VARIANTS["qwen3_moe"]).table.rows)
    assert "model.layers.$L.mlp.experts.$E.gate_proj.weight -> moe.experts.gate.kernel[$L in {moe_layers}, $E] : transpose" in lines
    assert "model.layers.$L.mlp.up_proj.weight -> mlp.up.kernel[$L in {dense_layers}] : transpose when has_dense_layers" in lines
    assert "lm_head.weight -> _ when tied" in lines


def test_a_group_with_no_layer_has_no_params():
    """DeepSeek without dense layers or MTP modules: no `mlp` / `mtp` params (a dimension 0),
    while their rules stay (empty index lists match nothing)."""
    cfg = VARIANTS["deepseek_v3_all_moe_tied_mtp"]
    assert {"mlp", "lm_head"}.isdisjoint(models.param_shape_tree(cfg))
    plain = dataclasses.replace(cfg, num_nextn_predict_layers=0, mtp_layers=0)
    assert "mtp" not in models.param_shape_tree(plain) and "mtp" in models.param_shape_tree(cfg)
    assert "mtp.head.kernel[$M in {mtp_layers}]" in models.hf_rules(plain)[0]


def test_table_errors_name_the_table_and_row():
    def dims(cfg):
        return {"E": 4, "N": None}

    with pytest.raises(ConfigError, match=r"models/toy/params.py row 1 \(w\): 2 dims \('E', 'E'\) but axes \('embed',\)"):
        ParamTable("models.toy.params", dims, (Param("w", ("E", "E"), ("embed",), "w"),))
    with pytest.raises(ConfigError, match="row 1 \\(w\\): when 'if tied'; expected 'VAR' or 'not VAR'"):
        ParamTable("models.toy.params", dims, (Param("w", ("E",), (None,), "w", when="if tied"),))
    with pytest.raises(ConfigError, match="row 1 \\(w\\): init 'random'"):
        ParamTable("models.toy.params", dims, (Param("w", ("E",), (None,), "w", init="random"),))
    table = ParamTable("models.toy.params", dims, (Param("w", ("N",), (None,), "w"), Drop("b", when="tied")))
    with pytest.raises(ConfigError, match="models/toy/params.py row 1 \\(w\\): dimension 'N' is None"):
        table.specs(None, {})
    table = ParamTable("models.toy.params", dims, (Param("w", ("E",), (None,), "w", when="tied"),))
    with pytest.raises(ConfigError, match="row 1: when 'tied': 'tied' is not a rule variable"):
        table.specs(None, {"bias": True})
    assert table.specs(None, {"tied": False}) == {}
    rows = stack("layers", (Param("w", ("E",), (None,), "m.$L.w", "transpose", stacked="$E"),), dim="N")
    assert rows[0].line() == "m.$L.w -> layers.w[$L, $E] : transpose"
    assert rows[0].shape == ("N", "E") and rows[0].axes == ("layers", None)


# ------------------------------------------------------------------ a family from a table alone

TOY = '''
"""A toy family: a config, its rule variables and its param table; no Flax module anywhere."""
from dataclasses import dataclass

from hybridckpt.models.family import Family
from hybridckpt.models.table import Drop, Param, ParamTable, stack


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    width: int
    num_layers: int
    tie_word_embeddings: bool = False

    @property
    def family(self):
        return "toy"


def from_hf(d, source):
    return ToyConfig(d["vocab_size"], d["width"], d["num_layers"], d.get("tie_word_embeddings", False))


def to_hf(cfg):
    return {"architectures": ["ToyForCausalLM"], "vocab_size": cfg.vocab_size, "width": cfg.width,
            "num_layers": cfg.num_layers, "tie_word_embeddings": cfg.tie_word_embeddings}


def rule_variables(cfg):
    return dict(num_heads=1, num_kv_heads=1, head_dim=cfg.width, hidden_size=cfg.width,
                vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, intermediate_size=cfg.width,
                tied=cfg.tie_word_embeddings)


TABLE = ParamTable(
    __name__,
    lambda cfg: {"V": cfg.vocab_size, "W": cfg.width, "L": cfg.num_layers},
    (
        Param("embed.embedding", ("V", "W"), ("vocab", "embed"), "model.embed.weight"),
        *stack("layers", (
            Param("w.kernel", ("W", "W"), ("embed", "mlp"), "model.layers.$L.w.weight", "transpose"),
            Param("norm.scale", ("W",), (None,), "model.layers.$L.norm.weight", init="ones"),
        )),
        Param("lm_head.kernel", ("W", "V"), ("embed", "vocab"), "lm_head.weight", "transpose", when="not tied"),
        Drop("lm_head.weight", when="tied"),
        Drop("model.layers.$L.buffer"),
    ),
)

FAMILY = Family(
    name="toy",
    config_cls=ToyConfig,
    hf_architectures=("ToyForCausalLM",),
    hf_model_types=("toy",),
    config_from_hf=from_hf,
    config_to_hf=to_hf,
    table=TABLE,
    rule_variables=rule_variables,
    module="hybridckpt.models.toy.module:Toy",  # never imported: no job here runs the model
)
'''

TOY_RUN = '''
import json, sys
import numpy as np
from safetensors.numpy import load_file, save_file
from hybridckpt import jobs, models, plan
from hybridckpt.mesh import mesh_from_shape

models.__path__.append(sys.argv[1])
src, dst, out = sys.argv[2:5]
assert set(models.families()) >= {"toy", "llama"}
rng = np.random.default_rng(0)
hf = {"model.embed.weight": rng.normal(size=(6, 4)), "lm_head.weight": rng.normal(size=(6, 4))}
for i in range(3):
    hf[f"model.layers.{i}.w.weight"] = rng.normal(size=(4, 4))
    hf[f"model.layers.{i}.norm.weight"] = rng.normal(size=(4,))
    hf[f"model.layers.{i}.buffer"] = np.arange(3.0)  # no param: dropped by its row
hf = {k: v.astype(np.float32) for k, v in hf.items()}
save_file(hf, f"{src}/model.safetensors")
json.dump({"architectures": ["ToyForCausalLM"], "vocab_size": 6, "width": 4, "num_layers": 3},
          open(f"{src}/config.json", "w"))

cfg = jobs.open_checkpoint(src).config
assert models.config_from_dict(models.config_to_dict(cfg)) == cfg
assert models.hf_rules(cfg)[1].endswith("toy/__init__.py table")
try:
    models.config_from_hf({"architectures": ["Nope"]})
except models.errors.ConfigError as e:
    assert "ToyForCausalLM" in str(e), e
assert models.param_shape_tree(cfg) == {"embed": {"embedding": (6, 4)}, "lm_head": {"kernel": (4, 6)},
                                        "layers": {"w": {"kernel": (3, 4, 4)}, "norm": {"scale": (3, 4)}}}
mesh = mesh_from_shape("fsdp=2,tp=2")
p = plan.for_model(cfg, mesh)
specs = {k: tuple(s.spec) for k, s in p.param_shardings["layers"]["w"].items()}
assert specs == {"kernel": (None, "fsdp", "tp")}, specs  # layers -> pp (1 here), embed, mlp
assert tuple(p.param_shardings["embed"]["embedding"].spec) == ("tp", "fsdp")
assert p.chunk_axes["layers"]["norm"]["scale"] == (0,) and p.chunk_axes["embed"]["embedding"] == ()

jobs.import_checkpoint(src, dst, mesh="fsdp=2,tp=2")
jobs.export_checkpoint(dst, out)
back = load_file(f"{out}/model.safetensors")
want = {k: v for k, v in hf.items() if not k.endswith(".buffer")}
assert sorted(back) == sorted(want), sorted(back)
for k, v in want.items():
    assert back[k].dtype == v.dtype and back[k].tobytes() == v.tobytes(), k
assert "hybridckpt.models.toy.module" not in sys.modules and "flax" not in sys.modules
print("ok")
'''


def test_a_family_defined_by_a_table_alone_imports_exports_and_plans(tmp_path):
    """Adding a family is adding a folder: a toy family outside the tree (on `models.__path__`),
    with a config, rule variables and a table but no Flax module, is found by the registry; an
    HF folder of it imports on a mesh, exports bit for bit (its buffer dropped by a `Drop` row),
    and plans by the table's axes; Flax is never imported."""
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text(TOY)
    dirs = [tmp_path / d for d in ("src", "imported", "exported")]
    dirs[0].mkdir()
    env = {**os.environ, "JAX_PLATFORMS": "cpu",  # (the compile level as conftest.py sets it)
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TOY_RUN), str(tmp_path), *map(str, dirs)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
    assert json.loads((dirs[2] / "config.json").read_text())["architectures"] == ["ToyForCausalLM"]
