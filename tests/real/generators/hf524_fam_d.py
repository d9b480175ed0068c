"""Qwen3-VL, Qwen2.5-VL and Qwen3-Next (issue 41) as transformers 5.24's own `save_pretrained` writes them
(safetensors, its default `save_original_format=True`), bf16:

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_d

(the pins are index_optim's: its venv serves). Cases, each tiny (hidden 16, 2 layers, vocab 64, a
two-block vision tower of width 8):
- `hf524_qwen3_vl`: a Qwen3VLForConditionalGeneration, tied (as Qwen3-VL-2B/4B), interleaved
  M-RoPE `mrope_section` [2, 1, 1], one DeepStack merger (after block 1); names `model.language_model.*`,
  `model.visual.*` (5.24 saves the module names).
- `hf524_qwen2_5_vl`: a Qwen2_5_VLForConditionalGeneration, untied, chunked M-RoPE [1, 1, 2];
  5.24 saves the released names (`model.*`, `visual.*`), not its module names.
- `hf524_qwen3_next`: a Qwen3NextForCausalLM with transformers' default layer pattern (three
  gated delta-net layers, then full attention; 4 layers), partial rotary 0.25 in `rope_parameters`, two
  value heads per key head, 4 experts (top-2) and the gated shared expert; per-expert names.

Weights are moved off their init (seeded normal) before saving. References: every parameter as
transformers holds it after `from_pretrained` reads the folder back (its state dict, under the
name it is saved as: Qwen3-Next's fused experts split per expert, as saved; float32; a tied head
left out), the logits of that model's own forward (fp32,
eager attention; Qwen3-Next's torch reference delta-rule kernels) on `tokens` with no position
ids (text only), and for the VL models `logits_mrope`, its logits given the 3-axis
`position_ids` [3, batch, seq] (temporal / height / width apart).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(7).integers(0, 60, size=(2, 8)).astype(np.int64)
POSITIONS = np.random.default_rng(8).integers(0, 24, size=(3, 2, 8)).astype(np.int64)
TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)
# module names -> the names save_pretrained gives them (Qwen2.5-VL's legacy layout)
SAVED_AS = {"hf524_qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual."))}


def _randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))


def _case(out: str, name: str, model) -> None:
    import transformers
    from safetensors import safe_open

    case = tools.fresh_case(out, name)
    ckpt = os.path.join(case, "ckpt")
    _randomize(model)
    model.to(torch.bfloat16).save_pretrained(ckpt)
    back = type(model).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(torch.from_numpy(TOKENS), use_cache=False).logits.float().numpy()
        mrope = None
        if "VL" in type(model).__name__:
            mrope = back(torch.from_numpy(TOKENS), position_ids=torch.from_numpy(POSITIONS)).logits.float().numpy()
    refs = {}
    for k, v in back.state_dict().items():
        for held, saved in SAVED_AS.get(name, ()):
            if k.startswith(held):
                k = saved + k[len(held):]
                break
        v = v.detach().float().numpy()
        if k.endswith(".experts.gate_up_proj"):  # held fused [X, 2I, E], saved per expert [I, E]
            for e, w in enumerate(v):
                half = w.shape[0] // 2
                refs[f"{k[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = w[:half]
                refs[f"{k[: -len('gate_up_proj')]}{e}.up_proj.weight"] = w[half:]
        elif k.endswith(".experts.down_proj"):  # held [X, E, I], saved per expert
            for e, w in enumerate(v):
                refs[f"{k[: -len('down_proj')]}{e}.down_proj.weight"] = w
        else:
            refs[k] = v
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    if model.config.tie_word_embeddings:
        refs = {k: v for k, v in refs.items() if not k.endswith("lm_head.weight")}
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    if mrope is not None:
        refs |= {"logits_mrope": mrope, "position_ids": POSITIONS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} save_pretrained (safetensors)",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_d  ({' '.join(sys.argv[1:])})",
        references={"logits": "transformers' forward (fp32, eager) of the model from_pretrained read back, text only",
                    **({"logits_mrope": "the same forward given position_ids",
                        "position_ids": "3-axis (temporal, height, width) positions [3, batch, seq]"} if mrope is not None else {}),
                    "tokens": "the input ids",
                    "<hf name>": "each tensor of the model read back (state_dict, under the name it is saved as)"},
        files=sorted(os.listdir(ckpt)), architecture=type(model).__name__,
    )
    print(name, sorted(os.listdir(ckpt)), sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers as t

    torch.manual_seed(0)
    rope3 = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    vision3 = dict(depth=2, hidden_size=8, intermediate_size=12, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, out_hidden_size=16, num_position_embeddings=16, deepstack_visual_indexes=[1])
    q3 = t.Qwen3VLConfig(text_config=dict(TEXT, head_dim=8, rope_parameters=rope3), vision_config=vision3,
                         tie_word_embeddings=True, image_token_id=63, video_token_id=62, vision_start_token_id=60,
                         vision_end_token_id=61)
    _case(a.out, "hf524_qwen3_vl", t.Qwen3VLForConditionalGeneration(q3))
    rope25 = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]}
    vision25 = dict(depth=2, hidden_size=8, intermediate_size=12, num_heads=2, patch_size=4, out_hidden_size=16,
                    fullatt_block_indexes=[1], window_size=8)
    q25 = t.Qwen2_5_VLConfig(text_config=dict(TEXT, rope_parameters=rope25), vision_config=vision25,
                             image_token_id=63, video_token_id=62, vision_start_token_id=60, vision_end_token_id=61)
    _case(a.out, "hf524_qwen2_5_vl", t.Qwen2_5_VLForConditionalGeneration(q25))
    nxt = t.Qwen3NextConfig(**{**TEXT, "num_hidden_layers": 4}, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                            linear_value_head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                            shared_expert_intermediate_size=8)
    _case(a.out, "hf524_qwen3_next", t.Qwen3NextForCausalLM(nxt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
