"""An index-keyed optimizer state of Qwen2.5-VL, Qwen3-VL and Qwen3-Next named by the model
(`formats.index_naming`, the families' `named_parameters()` order), against transformers' own run.

Each case: a tiny model built by transformers 5.24, one AdamW step over the HF Trainer's two
groups (`Trainer.get_decay_parameter_names`: decay names, then the rest, each in
`named_parameters()` order, the vision tower's params included) with a random gradient, saved as
a Trainer folder writes it (`save_pretrained`, `optimizer.pt` by `torch.save`,
`trainer_state.json`). The truth of each moment under each saved name is written by transformers
itself: the same model holding the moment in place of each parameter, saved by `save_pretrained`
(so the wrappers' prefixes and Qwen3-Next's per-expert split of its fused experts are the
tool's). Qwen2.5-VL is saved under both spellings transformers writes (`model.` / `visual.`,
`model.language_model.` / `model.visual.`): the order must place either.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from hybridckpt.formats.registry import open_source

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_TEXT = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, pad_token_id=None, bos_token_id=None, eos_token_id=None)  # fmt: skip
_VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, out_hidden_size=32)


def _mrope(section):
    return {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}


# name -> (architecture, config kwargs, save_original_format)
CASES = {
    "qwen2_5_vl_released_names": ("Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(_TEXT, rope_parameters=_mrope([1, 1, 2])),
        vision_config=dict(_VISION, fullatt_block_indexes=[1], window_size=8)), True),
    "qwen2_5_vl_module_names": ("Qwen2_5_VLForConditionalGeneration", dict(
        text_config=dict(_TEXT, rope_parameters=_mrope([1, 1, 2])),
        vision_config=dict(_VISION, fullatt_block_indexes=[1], window_size=8)), False),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", dict(
        text_config=dict(_TEXT, rope_parameters=_mrope([2, 1, 1])),
        vision_config=dict(_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])), True),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        _TEXT, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_only_layers=[1], linear_conv_kernel_dim=3, linear_key_head_dim=4, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=8,
        shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2), True),
}  # fmt: skip


def _trainer_folder(tmp_path, arch: str, kwargs: dict, original: bool):
    """(Trainer-style folder after one AdamW step, {slot: {saved name: moment}} as transformers
    saves each moment, the Trainer's groups by live name)."""
    cls = getattr(transformers, arch)
    torch.manual_seed(0)
    model = cls(cls.config_class(**kwargs))
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    groups = [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    by_name = dict(named)
    opt = torch.optim.AdamW([{"params": [by_name[n] for n in groups[0]], "weight_decay": 0.1},
                             {"params": [by_name[n] for n in groups[1]], "weight_decay": 0.0}], lr=1e-3)  # fmt: skip
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    folder = tmp_path / "checkpoint-1"
    model.save_pretrained(folder, save_original_format=original)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    truth = {}
    for slot in ("exp_avg", "exp_avg_sq"):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(opt.state[p][slot])
        model.save_pretrained(tmp_path / slot, save_original_format=original)
        truth[slot] = load_file(str(tmp_path / slot / "model.safetensors"))
    return str(folder), truth


@pytest.mark.parametrize("case", CASES)
def test_every_moment_under_its_saved_name(tmp_path, case):
    folder, truth = _trainer_folder(tmp_path, *CASES[case])
    got = open_source(folder)  # (read keyed by index, named by the registry's `names` hook)
    assert got.index_optimizer is not None and got.optimizer is not None
    src = got
    family = src.config.family
    assert any(f"named_parameters() order of {family}" in n for n in got.notes), got.notes
    for slot, want in truth.items():
        slots = got.optimizer.slots[slot]
        assert sorted(slots) == sorted(want) == sorted(src.tensors), slot
        for name, w in want.items():
            assert np.array_equal(np.asarray(slots[name].materialize()), w), (slot, name)
    # the Trainer's no-decay group: every bias and norm, the tower's nn.LayerNorms among them
    no_decay = got.optimizer.hyper["groups"][1]["params"]
    assert no_decay and all("bias" in n or "norm" in n for n in no_decay)
