"""A user rules file (examples/llama_variant.rules) converts a renamed Llama variant to HF names.

The variant's tensors are built here from a random reference Llama in HF names (fused qkv rows
per kv group, [gate | up] stacked), saved as a plain safetensors checkpoint, and read back
through the same path as `hybridckpt import --rules FILE`.
"""

import json
import os

import numpy as np
import pytest
from fixtures import paddle_writer as pw
from safetensors.numpy import save_file

from hybridckpt import jobs, lazy, models
from hybridckpt.errors import MappingError
from hybridckpt.models import config_from_hf
from hybridckpt.rules import load_rules

RULES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "llama_variant.rules")


def to_variant(ref) -> dict[str, np.ndarray]:
    """HF names -> the variant's names, written independently of the rules file."""
    p = ref.params
    hd = p["model.layers.0.self_attn.k_proj.weight"].shape[0] // ref.kv_heads
    group = ref.heads // ref.kv_heads
    out = {
        "backbone.embed.weight": p["model.embed_tokens.weight"],
        "backbone.final_norm.scale": p["model.norm.weight"],
    }
    for i in range(ref.config["num_hidden_layers"]):
        h, b = f"model.layers.{i}.", f"backbone.blocks.{i}."
        q, k, v = (p[h + f"self_attn.{n}_proj.weight"] for n in "qkv")
        rows = []
        for g in range(ref.kv_heads):
            rows += [
                q[g * group * hd : (g + 1) * group * hd],
                k[g * hd : (g + 1) * hd],
                v[g * hd : (g + 1) * hd],
            ]
        out[b + "attn.wqkv.weight"] = np.concatenate(rows)
        out[b + "attn.wo.weight"] = p[h + "self_attn.o_proj.weight"]
        out[b + "attn_norm.scale"] = p[h + "input_layernorm.weight"]
        out[b + "ffn_norm.scale"] = p[h + "post_attention_layernorm.weight"]
        out[b + "ffn.w13.weight"] = np.concatenate(
            [p[h + "mlp.gate_proj.weight"], p[h + "mlp.up_proj.weight"]]
        )
        out[b + "ffn.w2.weight"] = p[h + "mlp.down_proj.weight"]
    if not ref.tied:
        out["head.weight"] = p["lm_head.weight"]
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_variant_rules_file(tmp_path, tied):
    ref = pw.reference_llama(11, tied=tied, kv_heads=2, heads=4)
    variant = to_variant(ref)
    save_file(variant, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(ref.config))
    opened = jobs.open_checkpoint(str(tmp_path), rules=RULES)
    got = opened.named.params
    assert set(got) == set(ref.params)
    for k, v in ref.params.items():
        assert np.array_equal(got[k].materialize(), v), k
    # the fused source is not the HF layout: the rules did the work
    q = ref.params["model.layers.0.self_attn.q_proj.weight"]
    assert variant["backbone.blocks.0.attn.wqkv.weight"].shape != q.shape
    # and the derived inverse gives the variant back bit for bit
    rules = load_rules(RULES, models.rule_variables(config_from_hf(ref.config)))
    back = rules.invert().apply({k: lazy.ArrayTensor(v) for k, v in ref.params.items()}).tensors
    assert set(back) == set(variant)
    for k, v in variant.items():
        assert np.array_equal(back[k].materialize(), v), k


def test_variant_rules_refuse_unknown_names(tmp_path):
    ref = pw.reference_llama(12)
    variant = to_variant(ref)
    variant["backbone.blocks.0.attn.rope_cache"] = np.zeros(4, np.float32)
    rules = load_rules(RULES, models.rule_variables(config_from_hf(ref.config)))
    with pytest.raises(MappingError, match=r"backbone\.blocks\.0\.attn\.rope_cache"):
        rules.apply({k: lazy.ArrayTensor(v) for k, v in variant.items()})
