"""Legacy Hugging Face torch shards, written by transformers 4.57's own `save_pretrained(
safe_serialization=False)` (transformers 5.x no longer writes them; many older hub repos hold
nothing else).

    python tests/real/make.py hf_legacy

Cases:
- `hf_bin_qwen2_tied`: a tiny Qwen2ForCausalLM with a tied head (q/k/v biases), one
  `pytorch_model.bin`; the writer stores `lm_head.weight` as a view of the embedding's storage.
- `hf_bin_llama_sharded`: a tiny LlamaForCausalLM, untied, saved with a small `max_shard_size`:
  `pytorch_model-0000i-of-0000N.bin` + `pytorch_model.bin.index.json`.

Weights are moved off their init (seeded normal) before saving. References: every parameter of
the model as transformers holds it (HF names, float32; the tied head left out, as an export writes
it), the logits of the model's own forward (fp32, eager attention) after `from_pretrained` reads the
folder back, and the tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(5).integers(0, 64, size=(2, 7)).astype(np.int64)
COMMON = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=64, max_position_embeddings=64, rms_norm_eps=1e-6)


def _randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _case(out: str, name: str, model, save_kwargs: dict) -> None:
    import transformers

    case = tools.fresh_case(out, name)
    ckpt = os.path.join(case, "ckpt")
    _randomize(model)
    model.save_pretrained(ckpt, safe_serialization=False, **save_kwargs)
    back = type(model).from_pretrained(ckpt, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(torch.from_numpy(TOKENS)).logits.float().numpy()
    refs = {k: v.detach().float().numpy() for k, v in back.named_parameters()}  # named_parameters: the tie once
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} save_pretrained(safe_serialization=False)",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"python tests/real/make.py hf_legacy  ({' '.join(sys.argv[1:])})",
        references={"logits": "transformers' forward (fp32, eager) of the model from_pretrained read back",
                    "tokens": "the input ids", "<hf name>": "each parameter (named_parameters: a tied head once)"},
        files=sorted(os.listdir(ckpt)), tied=bool(model.config.tie_word_embeddings),
    )
    print(name, sorted(os.listdir(ckpt)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    _case(a.out, "hf_bin_qwen2_tied", Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **COMMON)), {})
    _case(a.out, "hf_bin_llama_sharded", LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **COMMON)),
          {"max_shard_size": "12KB"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
