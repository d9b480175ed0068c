"""DeepSeek V3.2 as transformers 5.24's own `save_pretrained` writes it (safetensors), issue 41:

    python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim --no-install hf524_ds32

(index_optim's venv has these pins: transformers 5.24.0, torch 2.13.0 CPU). One case, tiny (hidden
16, vocab 48, 4 layers, 4 experts), `hf524_deepseek_v32`: a DeepseekV32ForCausalLM cast to bf16
(`model.to(torch.bfloat16)`: every tensor, the routers' too) and saved, 2 dense
layers then 2 MoE layers (shared expert, sigmoid router with a drawn `e_score_correction_bias`,
2 groups of 2 experts, 1 group kept), q LoRA, yarn RoPE with mscale, and the lightning indexer of
4 heads of 8 (4 rotated) keeping `index_topk` 4 keys: the 12-token sequence is masked by the
selection from its 5th query on.

Weights are moved off their init (seeded normal; norms around 1; the routers' correction bias,
a buffer transformers initialises to 0, too) before saving. The seed is the first from 0 whose
index scores (transformers' own, recorded in its forward) have no tie at the edge of the top 4 in
any layer: the order of equal scores is torch's unspecified choice (the ReLU cuts many scores to
exactly 0 with few index heads), so a reference with such a tie would test torch's sort, not the
model. References: every tensor as transformers holds it after `from_pretrained` reads the folder
back in its stored dtype (its state dict; the experts it holds fused split under the names it
saves; bf16 stored as float32, exactly), the logits of its fp32 load's forward (eager attention),
the tokens.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import tools
import torch

TOKENS = np.random.default_rng(12).integers(0, 48, size=(2, 12)).astype(np.int64)
COMMAND = (
    "python tests/real/make.py --venv ~/.cache/hybridckpt-real/index_optim --no-install hf524_ds32"
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
CONFIG = dict(
    vocab_size=48,
    hidden_size=16,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_shared_experts=1,
    n_routed_experts=4,
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=4,
    v_head_dim=4,
    qk_nope_head_dim=4,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    max_position_embeddings=64,
    rope_parameters=YARN,
    index_topk=4,
    index_head_dim=8,
    index_n_heads=4,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
CASE = "hf524_deepseek_v32"


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            centre = 1.0 if name.endswith(("norm.weight", "layernorm.weight")) else 0.0
            p.copy_(centre + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _forward(model) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits, each layer's index scores `[b, s, s]` as its topk ranks them)."""
    scores = []
    topk = torch.Tensor.topk

    def recording(t, k, *args, **kw):
        if t.ndim == 3 and t.shape[-2:] == (TOKENS.shape[1],) * 2:
            scores.append(t.detach().numpy().copy())
        return topk(t, k, *args, **kw)

    torch.Tensor.topk = recording
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(TOKENS)).logits.float().numpy()
    finally:
        torch.Tensor.topk = topk
    return logits, scores


def _tie_free(scores: list[np.ndarray], k: int) -> bool:
    for s in scores:
        ranked = -np.sort(-s, axis=-1)[:, k:]  # queries k.. have more causal keys than k
        if not (ranked[..., k - 1] > ranked[..., k]).all():
            return False
    return len(scores) == CONFIG["num_hidden_layers"]


def _per_expert(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """A live tensor under the names `save_pretrained` writes: transformers 5 holds the experts
    fused (`mlp.experts.gate_up_proj` `[E, 2M, H]`, `down_proj` `[E, H, M]`), the file has
    `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base, m = name[: -len("gate_up_proj")], x.shape[1] // 2
        return {
            f"{base}{e}.{p}.weight": part
            for e in range(x.shape[0])
            for p, part in (("gate_proj", x[e, :m]), ("up_proj", x[e, m:]))
        }
    if name.endswith("mlp.experts.down_proj"):
        return {f"{name[: -len('down_proj')]}{e}.down_proj.weight": x[e] for e in range(x.shape[0])}
    return {name: x}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import transformers as t
    from safetensors import safe_open

    cfg = t.DeepseekV32Config(**CONFIG)
    for seed in range(50):
        model = t.DeepseekV32ForCausalLM(cfg).eval()
        _randomize(model, seed)
        if _tie_free(_forward(model)[1], CONFIG["index_topk"]):
            break
    else:
        raise SystemExit(
            "hf524_ds32: no seed below 50 without ties at the edge of the indexer's top k"
        )
    case = tools.fresh_case(a.out, CASE)
    ckpt = os.path.join(case, "ckpt")
    model.to(torch.bfloat16).save_pretrained(ckpt)
    back = t.DeepseekV32ForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    logits, scores = _forward(back)
    assert _tie_free(scores, CONFIG["index_topk"]), (
        "the bf16 weights tie where the fp32 ones did not"
    )
    held = t.DeepseekV32ForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16
    ).state_dict()  # as stored
    refs = {
        k: v
        for name, x in held.items()
        for k, v in _per_expert(name, x.detach().float().numpy()).items()
    }
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        names = set(f.keys())
    assert set(refs) == names, sorted(set(refs) ^ names)[:5]
    refs |= {"logits": logits, "tokens": TOKENS}
    tools.write_reference(case, refs)
    tools.record_manifest(
        case,
        tool=f"transformers {t.__version__} save_pretrained (safetensors, bfloat16)",
        dists=["transformers", "torch", "safetensors", "numpy"],
        command=f"{COMMAND}  ({' '.join(sys.argv[1:])})",
        references={
            "logits": "transformers' forward (fp32, eager) of the model from_pretrained read back",
            "tokens": "the input ids",
            "<hf name>": "each tensor of the model read back in its stored dtype (state_dict, the "
            "fused experts split under the names saved; bf16 as float32, exactly)",
        },
        files=sorted(os.listdir(ckpt)),
        architecture="DeepseekV32ForCausalLM",
        notes=[
            f"seed {seed}: the first without a tie at the edge of the indexer's top {CONFIG['index_topk']}"
        ],
    )
    print(CASE, sorted(os.listdir(ckpt)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
