"""Qwen2-MoE, SmolLM3 and Mistral 3 as transformers 5.24's own `save_pretrained` writes them
(safetensors, the Hub's names: transformers 5 converts its in-memory layout back on save).

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_a

(the pins are index_optim's: its venv serves). Cases, each tiny (hidden 16, vocab 64, < 100 KB):
- `hf524_smollm3`: a SmolLM3ForCausalLM of 4 layers as released (tied; `no_rope_layer_interval`
  4, so layer 3 is a NoPE layer).
- `hf524_qwen2_moe`: a Qwen2MoeForCausalLM of 4 layers: layers 1 and 3 dense (`mlp_only_layers`),
  0 and 2 MoE (4 experts, top-2, `norm_topk_prob` false) with the shared expert and its sigmoid
  `shared_expert_gate`; q/k/v biases.
- `hf524_mistral3`: a Mistral3ForConditionalGeneration (Mistral text model with head_dim 12 !=
  hidden / heads, rope theta 1e9; a Pixtral tower and the projector with its patch merger) as
  the Hub's Mistral-Small-3.1 is: the names 5.24 writes by default (`language_model.model.*`,
  `language_model.lm_head.weight`, `vision_tower.*`, `multi_modal_projector.*`), untied, the
  config.json's top-level `tie_word_embeddings` removed after the save (the Hub's has none:
  Mistral3Config's default, true, applies; transformers keeps the differing head it finds).
- `hf524_mistral3_tied_module_names`: the same wrapper tied, projector biases on, saved with
  `save_original_format=False` (the module tree's names: `model.language_model.*`,
  `model.vision_tower.*`, `model.multi_modal_projector.*`), no head in the file, the key
  removed too (so tied by the default).

Weights are moved off their init (seeded normal; routers wide, so the top-k differs across
tokens) before saving. References: every parameter as transformers holds it after
`from_pretrained` reads the folder back (its state dict under the names it is saved as;
float32; a tied head left out), the logits of that model's own forward (fp32, eager attention;
the wrapper with no image), the tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(11).integers(0, 60, size=(2, 8)).astype(np.int64)
# the wrapper's module names -> the names 5.24 saves by default (the llava conversion reversed)
SAVED_AS = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)
NO_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
TEXT = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def _randomize(model) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            scale = 1.0 if name.endswith("mlp.gate.weight") else 0.2  # routers: a wide spread
            p.copy_(centre + scale * torch.randn(p.shape, generator=g))


def _per_expert(name: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5's fused in-memory experts under the Hub's per-expert names it saves them
    as: `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's rows [gate | up]) and
    `mlp.experts.down_proj` [E, H, I] (conversion_mapping's qwen2_moe entry, reversed)."""
    stem, _, kind = name.rpartition(".")
    if not stem.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
        return {name: v}
    out = {}
    for e in range(v.shape[0]):
        if kind == "down_proj":
            out[f"{stem}.{e}.down_proj.weight"] = v[e]
        else:
            gate, up = v[e].chunk(2, dim=0)
            out[f"{stem}.{e}.gate_proj.weight"], out[f"{stem}.{e}.up_proj.weight"] = gate, up
    return out


def _case(
    out: str,
    name: str,
    model,
    *,
    original: bool = True,
    drop_keys: tuple[str, ...] = (),
    notes: tuple[str, ...] = (),
) -> None:
    import transformers
    from safetensors import safe_open

    case = tools.fresh_case(out, name)
    ckpt = os.path.join(case, "ckpt")
    _randomize(model)
    model.save_pretrained(ckpt, save_original_format=original)
    if drop_keys:
        path = os.path.join(ckpt, "config.json")
        with open(path) as f:
            d = json.load(f)
        with open(path, "w") as f:
            json.dump(
                {k: v for k, v in d.items() if k not in drop_keys}, f, indent=2, sort_keys=True
            )
            f.write("\n")
    back = (
        type(model).from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    )
    with torch.no_grad():
        logits = back(input_ids=torch.from_numpy(TOKENS)).logits.float().numpy()
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    renames = SAVED_AS if original and any(n.startswith("language_model.") for n in names) else ()
    refs = {}
    for k, v in back.state_dict().items():
        for held, saved in renames:
            if k.startswith(held):
                k = saved + k[len(held) :]
                break
        refs |= {n: t.detach().float().numpy() for n, t in _per_expert(k, v).items()}
    tied = (
        back.config.tie_word_embeddings
        and "lm_head.weight" not in names
        and "language_model.lm_head.weight" not in names
    )
    if tied:
        refs = {k: v for k, v in refs.items() if not k.endswith("lm_head.weight")}
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case,
        tool=f"transformers {transformers.__version__} save_pretrained (safetensors"
        f"{'' if original else ', save_original_format=False'})",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim hf524_fam_a  ({' '.join(sys.argv[1:])})",
        references={
            "logits": "transformers' forward (fp32, eager) of the model from_pretrained read back",
            "tokens": "the input ids",
            "<hf name>": "each tensor of the model read back (state_dict, under the name it is saved as)",
        },
        notes=list(notes),
        files=sorted(os.listdir(ckpt)),
        architecture=type(model).__name__,
        tied_after_load=bool(tied),
    )
    print(name, sorted(os.listdir(ckpt)), "tied" if tied else "untied")


def smollm3(out: str) -> None:
    import transformers as t

    cfg = t.SmolLM3Config(
        **TEXT,
        num_hidden_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        **NO_IDS,
    )
    assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.tie_word_embeddings
    _case(out, "hf524_smollm3", t.SmolLM3ForCausalLM(cfg))


def qwen2_moe(out: str) -> None:
    import transformers as t

    cfg = t.Qwen2MoeConfig(
        **TEXT,
        num_hidden_layers=4,
        mlp_only_layers=[1, 3],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=4,
        norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        **NO_IDS,
    )
    assert cfg.qkv_bias and not cfg.tie_word_embeddings
    model = t.Qwen2MoeForCausalLM(cfg)
    _case(out, "hf524_qwen2_moe", model)
    # the routers choose more than one pair of experts across the tokens (else top-k is untested)
    with torch.no_grad():
        routed = model(input_ids=torch.from_numpy(TOKENS), output_router_logits=True).router_logits
    for layer in routed:
        assert len({tuple(sorted(r)) for r in torch.topk(layer, 2, dim=-1).indices.tolist()}) >= 3


def _mistral3_config(**kwargs):
    import transformers as t

    text = dict(
        TEXT,
        model_type="mistral",
        num_hidden_layers=2,
        head_dim=12,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e9},
        **NO_IDS,
    )
    vision = dict(
        model_type="pixtral",
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=4,
        image_size=8,
        patch_size=4,
    )
    return t.Mistral3Config(text_config=text, vision_config=vision, image_token_index=63, **kwargs)


def mistral3(out: str) -> None:
    import transformers as t

    note = (
        "config.json's top-level tie_word_embeddings removed after save_pretrained, as the Hub's "
        "Mistral-Small-3.1 config.json has none; from_pretrained read the folder so (Mistral3Config's default "
        "is true: {})"
    )
    untied = _mistral3_config(tie_word_embeddings=False)
    _case(
        out,
        "hf524_mistral3",
        t.Mistral3ForConditionalGeneration(untied),
        drop_keys=("tie_word_embeddings",),
        notes=(
            note.format(
                "the head the file holds differs from the embedding, so transformers keeps it untied"
            ),
        ),
    )
    tied = _mistral3_config(multimodal_projector_bias=True)
    _case(
        out,
        "hf524_mistral3_tied_module_names",
        t.Mistral3ForConditionalGeneration(tied),
        original=False,
        drop_keys=("tie_word_embeddings",),
        notes=(note.format("no head in the file: tied"),),
    )


CASES = {"smollm3": smollm3, "qwen2_moe": qwen2_moe, "mistral3": mistral3}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--case", choices=sorted(CASES), action="append", help="only these (default: all)"
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    for name in a.case or CASES:
        CASES[name](a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
