"""Llama 4 as transformers 5.24's own `save_pretrained` writes it (safetensors), issue 41:

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_llama4

(index_optim's venv has these pins: transformers 5.24.0, torch 2.13.0 CPU). Cases, tiny (hidden
16, 4 layers, vocab 64, 4 experts):
- `hf524_llama4`: a Llama4ForCausalLM, fp32: MoE layers 1 and 3 between dense layers 0 and 2
  (`interleave_moe_layer_step` 2), NoPE layers 1 and 3 (`no_rope_layer_interval` 2) with
  attention temperature tuning (`floor_scale` 4, `attn_scale` 0.5: the scale steps inside the
  12-token sequence), chunked attention of 5 on the RoPE layers (the sequence crosses two chunk
  boundaries), the L2 q/k norm, llama3 RoPE scaling (factor 8, low 1, high 4);
- `hf524_llama4_mm`: a Llama4ForConditionalGeneration saved in bf16 (as the releases are): every
  text layer MoE, Scout's RoPE (llama3, factor 16, low_freq_factor == high_freq_factor == 1), no
  q/k norm (Maverick's), a tiny vision tower (one layer, image 8, patch 4) whose pixel-shuffle
  adapter and projector fit its sizes (its forward runs), tensor names `language_model.model.*`,
  `vision_model.*`, `multi_modal_projector.*`.

Weights are moved off their init (seeded normal; norms around 1) before saving. References: every
parameter as transformers holds it after `from_pretrained` reads the folder back (its state dict,
under the names it is saved as; bf16 stored as float32, exactly), the logits of that model's own
text forward (fp32, eager attention: the wrapper's `.language_model`, because the wrapper's
`forward` raises on a text prompt in 5.24, recorded in the manifest), the tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(11).integers(0, 60, size=(2, 12)).astype(np.int64)
COMMAND = "python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_llama4"
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
SCOUT_ROPE = {**LLAMA3, "factor": 16.0, "high_freq_factor": 1.0}
TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=8, intermediate_size_mlp=24, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=2, floor_scale=4,
            attn_scale=0.5, max_position_embeddings=64, rope_parameters=LLAMA3, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)
# pixel shuffle 0.5 of a 2 x 2 patch grid of width 8: one token of 32 = intermediate_size
VISION = dict(hidden_size=8, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
              patch_size=4, vision_output_dim=16, projector_input_dim=16, projector_output_dim=16)


def _randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))


def _case(out: str, name: str, model, dtype: torch.dtype, notes: list[str]) -> None:
    import transformers
    from safetensors import safe_open

    case = tools.fresh_case(out, name)
    ckpt = os.path.join(case, "ckpt")
    _randomize(model)
    model.to(dtype).save_pretrained(ckpt)
    back = type(model).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    text = back.language_model if isinstance(back, transformers.Llama4ForConditionalGeneration) else back
    with torch.no_grad():
        logits = text(torch.from_numpy(TOKENS)).logits.float().numpy()
    held = type(model).from_pretrained(ckpt, dtype=dtype).state_dict()  # as stored (bf16 stays bf16)
    refs = {k: v.detach().float().numpy() for k, v in held.items()}
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} save_pretrained (safetensors, {str(dtype)[6:]})",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"{COMMAND}  ({' '.join(sys.argv[1:])})",
        references={"logits": "transformers' text forward (fp32, eager) of the model from_pretrained read back",
                    "tokens": "the input ids",
                    "<hf name>": "each tensor of the model read back in its stored dtype (state_dict; bf16 as float32)"},
        files=sorted(os.listdir(ckpt)), architecture=type(model).__name__, notes=notes,
    )
    print(name, sorted(os.listdir(ckpt)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers as t

    torch.manual_seed(0)
    _case(a.out, "hf524_llama4", t.Llama4ForCausalLM(t.Llama4TextConfig(**TEXT)), torch.float32, [])
    text = dict(TEXT, interleave_moe_layer_step=1, use_qk_norm=False, rope_parameters=SCOUT_ROPE)
    mm = t.Llama4ForConditionalGeneration(t.Llama4Config(text_config=text, vision_config=VISION, image_token_index=63,
                                                         boi_token_index=61, eoi_token_index=62))
    wrapper = t.Llama4ForConditionalGeneration
    try:
        with torch.no_grad():
            mm(torch.from_numpy(TOKENS))
        raised = "the wrapper's forward ran"
    except AttributeError as e:  # 5.24: its output class reads `image_outputs` the text model does not give
        raised = f"{wrapper.__name__}.forward raises on a text prompt in this version ({e}); the logits are its .language_model's"
    _case(a.out, "hf524_llama4_mm", mm, torch.bfloat16, [raised])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
