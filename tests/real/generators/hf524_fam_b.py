"""GLM-4.5 and ERNIE 4.5 as transformers 5.24's own `save_pretrained` writes them (safetensors).

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_b

(index_optim's venv has these pins: transformers 5.24.0, torch 2.13.0). Cases, each tiny (hidden
16, 4 layers, vocab 32, 4 experts):
- `hf524_glm4_moe`: a Glm4MoeForCausalLM as GLM-4.5 (q/k norm, qkv biases, partial rotary 0.5,
  2 dense + 2 MoE layers, sigmoid router with its correction bias, 2 expert groups, a shared
  expert, routed_scaling_factor 2.5) saved in bf16 as the releases are: written in fp32, read back
  by `from_pretrained(dtype=bfloat16)`, which keeps the router's weight and
  `e_score_correction_bias` in fp32 (`_keep_in_fp32_modules_strict`), and saved again.
- `hf524_ernie4_5_moe`: an Ernie4_5_MoeForCausalLM as ERNIE-4.5-21B-A3B (tied, no biases, 2 shared
  experts, dense layers below `moe_layer_start_index`: 2 dense + 2 MoE layers), bf16 the same way
  (the router weight and `moe_statics.e_score_correction_bias` `[1, E]` kept fp32), saved under
  the stored names (transformers renames the bias back from its `mlp.gate.moe_statics.*`).
- `hf524_ernie4_5`: an Ernie4_5ForCausalLM as ERNIE-4.5-0.3B (tied, head_dim apart from hidden /
  heads), bf16.

Weights are moved off their init (seeded normal; the routers' correction biases too) before
saving. References: every tensor as transformers holds it after `from_pretrained` reads the
folder back (its state dict under the names it is saved as, as float32; the stored dtype of each
in the manifest's `dtypes`), the logits of that model's own forward (fp32 load, eager attention),
the tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(7).integers(0, 32, size=(2, 8)).astype(np.int64)
COMMAND = "python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_b"


def _randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _saved_names(state: dict) -> dict:
    """transformers' in-memory tensors under the names its save writes (the conversion it reverses
    on save: fused `mlp.experts.gate_up_proj` [X, 2M, E] -> `mlp.experts.N.{gate,up}_proj.weight`,
    `mlp.experts.down_proj` [X, E, M] -> `mlp.experts.N.down_proj.weight`; ERNIE's
    `mlp.gate.moe_statics.e_score_correction_bias` -> `mlp.moe_statics.e_score_correction_bias`)."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = t[e, :half], t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:  # ERNIE's correction bias: stored beside the router, held under it
            out[name.replace(".mlp.gate.moe_statics.", ".mlp.moe_statics.")] = t
    return out


def _case(out: str, name: str, model, *, bf16: bool = False, notes: list[str] | None = None) -> None:
    import transformers
    from safetensors import safe_open

    case = tools.fresh_case(out, name)
    ckpt = os.path.join(case, "ckpt")
    _randomize(model)
    if bf16:  # as the releases: bf16, the modules transformers keeps in fp32 kept so
        tmp = tempfile.mkdtemp()
        model.save_pretrained(tmp)
        type(model).from_pretrained(tmp, dtype=torch.bfloat16).save_pretrained(ckpt)
        shutil.rmtree(tmp)
    else:
        model.save_pretrained(ckpt)
    held = type(model).from_pretrained(ckpt)  # the stored dtypes, as transformers holds them
    state = _saved_names(held.state_dict())
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in state.items()}
    back = type(model).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(torch.from_numpy(TOKENS)).logits.float().numpy()
    refs = {k: v.detach().float().numpy() for k, v in state.items()}
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    if model.config.tie_word_embeddings:
        refs = {k: v for k, v in refs.items() if k != "lm_head.weight"}
        dtypes.pop("lm_head.weight", None)
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case, tool=f"transformers {transformers.__version__} save_pretrained (safetensors)",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"{COMMAND}  ({' '.join(sys.argv[1:])})",
        references={"logits": "transformers' forward (fp32 load, eager) of the saved folder",
                    "tokens": "the input ids",
                    "<hf name>": "each tensor of the model read back (state_dict, fused experts split under the "
                                 "per-expert names it is saved as), as float32; its stored dtype in `dtypes`"},
        files=sorted(os.listdir(ckpt)), architecture=type(model).__name__, dtypes=dtypes, notes=notes,
    )
    print(name, sorted(os.listdir(ckpt)), os.path.getsize(os.path.join(ckpt, "model.safetensors")))


def glm4_moe(t):
    cfg = t.Glm4MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=2, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, max_position_embeddings=64, rope_theta=5000.0,
        pad_token_id=None, eos_token_id=None, bos_token_id=None)
    return t.Glm4MoeForCausalLM(cfg)


def ernie4_5_moe(t):
    cfg = t.Ernie4_5_MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, moe_num_experts=4, moe_k=2, moe_num_shared_experts=2,
        moe_layer_start_index=2, max_position_embeddings=64, pad_token_id=None, eos_token_id=None,
        bos_token_id=None)
    return t.Ernie4_5_MoeForCausalLM(cfg)


def ernie4_5(t):
    cfg = t.Ernie4_5Config(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=12, max_position_embeddings=64, pad_token_id=None, eos_token_id=None,
        bos_token_id=None)
    return t.Ernie4_5ForCausalLM(cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers as t

    torch.manual_seed(0)
    _case(a.out, "hf524_glm4_moe", glm4_moe(t), bf16=True,
          notes=["transformers drops GLM's MTP layers on load and writes none: this case has none "
                 "(tests/families/test_glm4_moe.py appends one)"])
    _case(a.out, "hf524_ernie4_5_moe", ernie4_5_moe(t), bf16=True,
          notes=["transformers ignores ERNIE's MTP tensors on load and writes none: this case has none"])
    _case(a.out, "hf524_ernie4_5", ernie4_5(t), bf16=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
