"""Families new in issue 26 as transformers 4.57's own `save_pretrained` writes them (safetensors):
the config.json spellings of transformers 4 (top-level `rope_theta`, `rope_scaling`,
`partial_rotary_factor`, `rope_local_base_freq`) and the tensor names of the hub releases.

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/hf_legacy hf_families

(the pins are hf_legacy's: its venv serves). Cases:
- `hf457_gemma3_mm`: a tiny Gemma3ForConditionalGeneration (SigLIP tower without pooling head, as
  Gemma 3's releases): text `language_model.model.*`, tower `vision_tower.vision_model.*`,
  projector `multi_modal_projector.*`; `final_logit_softcapping` 30 in the text config (the
  wrapper's forward does not apply it).
- `hf457_phi3_longrope`: a tiny Phi3ForCausalLM with v4's `rope_scaling` {type longrope, short and
  long factors}, top-level `partial_rotary_factor` 0.5, `original_max_position_embeddings` 4 (the
  8-token forward uses the long factors), a sliding window of 5, fused `qkv_proj` and
  `gate_up_proj`.
- `hf457_olmo2`: a tiny Olmo2ForCausalLM (post-norms, q/k norms over the whole projection).
- `hf457_granite`: a tiny GraniteForCausalLM with Granite 3's four scalars, tied.

Weights are moved off their init (seeded normal) before saving. References: every parameter as
transformers holds it after `from_pretrained` reads the folder back (its state dict, under the
names it is saved as; float32; a tied head left out), the logits of that model's own forward (fp32, eager attention), the tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(7).integers(0, 60, size=(2, 8)).astype(np.int64)
# the wrapper's module names -> the names 4.57 saves (Gemma3ForConditionalGeneration's
# `_checkpoint_conversion_mapping` reversed); the text families save their module names
SAVED_AS = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))
TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


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
    model.save_pretrained(ckpt)
    back = type(model).from_pretrained(ckpt, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(torch.from_numpy(TOKENS)).logits.float().numpy()
    # every tensor as the model holds it, under the name save_pretrained gave it (4.57 renames the
    # wrapper's module names back to the hub's on save: `_checkpoint_conversion_mapping`)
    refs, renames = {}, SAVED_AS if getattr(back, "_checkpoint_conversion_mapping", None) else ()
    for k, v in back.state_dict().items():
        for held, saved in renames:
            if k.startswith(held):
                k = saved + k[len(held):]
                break
        refs[k] = v.detach().float().numpy()
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    if model.config.tie_word_embeddings:
        refs = {k: v for k, v in refs.items() if not k.endswith("lm_head.weight")}
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} save_pretrained (safetensors)",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"python tests/real/make.py --venv ~/.cache/hybridckpt-real/hf_legacy hf_families  ({' '.join(sys.argv[1:])})",
        references={"logits": "transformers' forward (fp32, eager) of the model from_pretrained read back",
                    "tokens": "the input ids",
                    "<hf name>": "each tensor of the model read back (state_dict, under the name it is saved as)"},
        files=sorted(os.listdir(ckpt)), architecture=type(model).__name__,
    )
    print(name, sorted(os.listdir(ckpt)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers as t

    torch.manual_seed(0)
    gemma_text = dict(TEXT, head_dim=8, sliding_window=3, final_logit_softcapping=30.0)
    vision = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, vision_use_head=False)
    mm = t.Gemma3Config(text_config=gemma_text, vision_config=vision, mm_tokens_per_image=1, image_token_index=63,
                        boi_token_index=61, eoi_token_index=62)
    _case(a.out, "hf457_gemma3_mm", t.Gemma3ForConditionalGeneration(mm))
    phi = t.Phi3Config(**TEXT, original_max_position_embeddings=4, partial_rotary_factor=0.5, sliding_window=5,
                       rope_theta=5000.0, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                       rope_scaling={"type": "longrope", "short_factor": [1.0, 2.5], "long_factor": [3.0, 7.0]})
    _case(a.out, "hf457_phi3_longrope", t.Phi3ForCausalLM(phi))
    _case(a.out, "hf457_olmo2", t.Olmo2ForCausalLM(t.Olmo2Config(**TEXT, pad_token_id=None, eos_token_id=None)))
    granite = t.GraniteConfig(**TEXT, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1.0,
                              logits_scaling=8.0, tie_word_embeddings=True)
    _case(a.out, "hf457_granite", t.GraniteForCausalLM(granite))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
