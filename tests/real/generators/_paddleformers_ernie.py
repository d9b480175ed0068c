"""ERNIE 4.5 runs of the PaddleFormers 1.2 generator (`paddleformers.py`, `ERNIE_RUNS`).

Each case is one training run of a tiny ERNIE 4.5 by `paddleformers.trainer.Trainer` on CPU, one
rank, fp32, the generator's AdamW and `STEPS`, saved by the Trainer as a FlexCheckpoint
(`ckpt/flex/checkpoint-N`, its default) with `model.config.save_pretrained` beside it:
- `paddleformers_ernie4_5_moe`: `Ernie4_5_MoeForCausalLM`, layers 0-1 dense, 2-3 mixtures of 4
  experts (top 2) plus one shared expert, tied head, no MTP; the routing of the MoE block in plain
  Paddle ops (`_paddleformers_shims.moe_on_cpu`: the CPU wheel lacks its kernels);
- `paddleformers_ernie4_5`: `Ernie4_5ForCausalLM`, tied head, head_dim 8 (not hidden / heads: 4).
Every param is moved off its init before training (matrices N(0, 0.1), vectors and the
`[1, experts]` correction bias 1 + N(0, 0.1) and N(0, 0.3): the bias changes the choice).

What PaddleFormers holds, and so saves (`model.sharded_state_dict()`): its own module names, not
HF's: q/k/v fused into `self_attn.qkv_proj.weight` `[hidden, kv_heads * (heads/kv_heads + 2) *
head_dim]` (per kv group `[q heads of the group | k | v]`, Ernie4_5Attention.forward), gate/up
into `up_gate_proj.weight` `[hidden, 2 * width]` (`[gate | up]`, nn/mlp.py MLP.forward chunks
it), every Linear `[in, out]`, the router `mlp.gate.weight` `[hidden, experts]`.

References from Paddle's runtime after the save, by HF name in HF layout: this module splits and
transposes PaddleFormers' tensors in numpy (`hf_state`, independent of hybridckpt's rules) and
digests them (`manifest["digests"]`: params, exp_avg, exp_avg_sq); `logits` is the trained
model's own eval forward of `tokens` (fp32).
"""

from __future__ import annotations

import json
import os

import numpy as np

ERNIE_RUNS = {
    "paddleformers_ernie4_5_moe": {"family": "ernie4_5_moe", "tied": True, "prec": "fp32", "par": "1rank",
                                   "formats": ["flex"]},
    "paddleformers_ernie4_5": {"family": "ernie4_5", "tied": True, "prec": "fp32", "par": "1rank",
                               "formats": ["flex"]},
}
BASE = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, fuse_rms_norm=False,
            use_bias=False, tie_word_embeddings=True)
MOE = dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=1, moe_layer_start_index=2,
           moe_layer_end_index=3, moe_layer_interval=1, num_nextn_predict_layers=0, moe_use_aux_free=True,
           moe_aux_loss_lambda=0.0, moe_z_loss_lambda=0.0, moe_orthogonal_loss_lambda=0.0)
STATICS = "mlp.moe_statics.e_score_correction_bias"


def model_of(spec):
    import paddleformers.transformers as pt

    if spec["family"] == "ernie4_5_moe":  # 4 layers: 2 dense, 2 MoE (pp=2 splits each stack)
        return pt.Ernie4_5_MoeConfig(**{**BASE, "num_hidden_layers": 4}, **MOE), pt.Ernie4_5_MoeForCausalLM
    return pt.Ernie4_5Config(**BASE, head_dim=8), pt.Ernie4_5ForCausalLM  # head_dim != hidden / heads


def perturb(model) -> None:
    """Every param off its init: matrices N(0, 0.1), vectors 1 + N(0, 0.1), the correction bias
    N(0, 0.3) (one rank: local = global)."""
    for i, (key, p) in enumerate(sorted(model.state_dict().items())):
        rng = np.random.default_rng(2000 + i)
        shape = tuple(p.shape)
        if key.endswith(STATICS):
            full = rng.normal(0, 0.3, shape)
        else:
            full = rng.normal(0, 0.1, shape) + (1.0 if len(shape) == 1 else 0.0)
        p.set_value(full.astype(np.float32))


def worker(spec: dict, shims, training_args, pieces, assemble, tokens) -> None:
    """One run: train, save (the Trainer), gather the runtime state and the logits."""
    import paddle

    if spec["family"] == "ernie4_5_moe":
        shims.moe_on_cpu()
    from paddleformers.trainer import Trainer

    cfg, cls = model_of(spec)
    paddle.seed(0)
    model = cls(cfg)
    perturb(model)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 64, 16).tolist(), "labels": rng.integers(0, 64, 16).tolist()}
            for _ in range(32)]
    trainer = Trainer(model=model, args=training_args(spec, spec["out"]), train_dataset=data)
    trainer.train()
    model.config.save_pretrained(spec["out"])
    msd = trainer.model.sharded_state_dict()
    state = assemble([pieces(msd) + pieces(trainer.optimizer.sharded_state_dict(msd))])
    model.eval()
    with paddle.no_grad():
        out = model(paddle.to_tensor(tokens))
    logits = (out[0] if isinstance(out, tuple) else out.logits).numpy()
    np.savez(os.path.join(spec["runtime"], "state.npz"), **{k: a for k, (a, _) in state.items()})
    np.save(os.path.join(spec["runtime"], "logits.npy"), logits)
    with open(os.path.join(spec["runtime"], "meta.json"), "w") as f:
        json.dump({"dtypes": {k: d for k, (_, d) in state.items()}, "notes": shims.NOTES,
                   "transpose_weight_keys": list(cls.transpose_weight_keys),
                   "config": {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))},
                   "stop_gradient": sorted(k for k, p in model.named_parameters() if p.stop_gradient)}, f)


def split_param(name: str, arr: np.ndarray, heads: int, kv_heads: int) -> dict[str, np.ndarray]:
    """One PaddleFormers tensor (or its moment) -> HF names and layouts (module docstring)."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        pre = name[: -len("qkv_proj.weight")]
        hd = arr.shape[1] // (heads + 2 * kv_heads)
        g = heads // kv_heads
        per = arr.T.reshape(kv_heads, (g + 2) * hd, arr.shape[0])
        q, k, v = per[:, : g * hd], per[:, g * hd : (g + 1) * hd], per[:, (g + 1) * hd :]
        return {f"{pre}{n}_proj.weight": np.ascontiguousarray(t.reshape(-1, arr.shape[0]))
                for n, t in (("q", q), ("k", k), ("v", v))}
    if name.endswith(".up_gate_proj.weight"):
        pre = name[: -len("up_gate_proj.weight")]
        gate, up = np.split(arr.T, 2, axis=0)
        return {f"{pre}gate_proj.weight": np.ascontiguousarray(gate), f"{pre}up_proj.weight": np.ascontiguousarray(up)}
    if arr.ndim == 2 and name.endswith((".o_proj.weight", ".down_proj.weight", ".mlp.gate.weight")):
        return {name: np.ascontiguousarray(arr.T)}
    return {name: arr}


def hf_state(runtime: str, spec: dict):
    """(kind -> HF name -> (array, dtype), (beta1 pow, beta2 pow), meta) of a run's runtime state."""
    with open(os.path.join(runtime, "meta.json")) as f:
        meta = json.load(f)
    z = np.load(os.path.join(runtime, "state.npz"))
    heads, kv = BASE["num_attention_heads"], BASE["num_key_value_heads"]
    out: dict = {"params": {}, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    pows: dict = {"beta1_pow": set(), "beta2_pow": set()}
    kinds = {".moment1_0": "exp_avg", ".moment2_0": "exp_avg_sq", ".w_0": "master",
             ".beta1_pow_acc_0": "beta1_pow", ".beta2_pow_acc_0": "beta2_pow"}
    for key in z.files:
        kind, name = "params", key
        for suffix, k in kinds.items():
            if key.endswith(suffix):
                kind, name = k, key[: -len(suffix)]
        if kind in pows:
            pows[kind].add(float(z[key].reshape(-1)[0]))
            continue
        for n, a in split_param(name, z[key], heads, kv).items():
            out[kind][n] = (a, meta["dtypes"][key])
    emb = "model.embed_tokens.weight"
    for kind, d in out.items():  # tied: the head's state is the embedding's
        if "lm_head.weight" in d:
            head = d.pop("lm_head.weight")
            if emb in d:
                assert np.array_equal(d[emb][0], head[0]), f"tied {kind}: head != embedding"
            else:
                d[emb] = head
    assert all(len(v) == 1 for v in pows.values()), pows
    return out, (pows["beta1_pow"].pop(), pows["beta2_pow"].pop()), meta


def make_case(gen, out_root: str, case: str, run: dict, tmp: str) -> None:
    """An ERNIE 4.5 case: the FlexCheckpoint, the runtime digests by HF name in HF layout,
    Paddle's logits (`gen`: the generator module, paddleformers.py, for its run helpers and
    hyperparameters)."""
    import shutil

    import tools
    out, runtime = os.path.join(tmp, case, "flex"), os.path.join(tmp, case, "flex.runtime")
    os.makedirs(runtime, exist_ok=True)
    spec = {**run, "format": "flex_checkpoint", "out": out, "runtime": runtime}
    gen._run(spec, os.path.join(tmp, case, "flex.log"), 1)
    state, pows, meta = hf_state(runtime, run)
    case_dir = tools.fresh_case(out_root, case)
    shutil.copytree(out, os.path.join(case_dir, "ckpt", "flex"))
    logits = np.load(os.path.join(runtime, "logits.npy"))
    tools.write_reference(case_dir, {"tokens": gen.TOKENS.astype(np.int32), "logits": logits})
    digests = {kind: {k: {"sha256": gen._digest(arr), "dtype": dt, "shape": list(arr.shape)}
                      for k, (arr, dt) in d.items()} for kind, d in state.items()}
    arch = {"ernie4_5_moe": "Ernie4_5_MoeForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM"}[run["family"]]
    tools.record_manifest(
        case_dir,
        tool="PaddleFormers Trainer (paddleformers.trainer.Trainer) on paddlepaddle (CPU)",
        dists=gen.DISTS,
        command=f"python tests/real/make.py paddleformers --only {case}",
        references={
            "tokens": "[1, seq] int32 ids for the logits",
            "logits": f"[1, seq, vocab] fp32: the trained PaddleFormers {arch}'s own eval forward of tokens",
        },
        notes=[*meta["notes"],
               "runtime state gathered from model.sharded_state_dict() and optimizer.sharded_state_dict() "
               "after the save; digests are of HF names and layouts: qkv_proj split per kv group "
               "[q heads | k | v], up_gate_proj split [gate | up], every Linear (and the router "
               "mlp.gate.weight) transposed from Paddle's [in, out] (_paddleformers_ernie.split_param)",
               "the flex output folder's config.json is model.config.save_pretrained's"],
        what=f"tied {arch}, fp32, 1 rank, FlexCheckpoint",
        formats={"flex": f"ckpt/flex/checkpoint-{gen.STEPS}"},
        run=run,
        steps=gen.STEPS,
        hyper={"lr": gen.LR, "weight_decay": gen.WD, "betas": list(gen.BETAS), "eps": gen.EPS, "lr_scheduler": "constant"},
        beta_pows=list(pows),
        digests=digests,
        architecture=arch,
        stop_gradient=meta["stop_gradient"],
        transpose_weight_keys=meta["transpose_weight_keys"],
    )
