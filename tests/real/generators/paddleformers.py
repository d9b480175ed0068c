"""PaddleFormers 1.2 Trainer checkpoints (FlexCheckpoint and unified), written by the Trainer itself.

    python tests/real/make.py paddleformers [--only CASE]

(`_paddleformers_check_export.py`: does PaddleFormers itself load our `export --to
paddleformers-unified`? Its docstring says how to run it.)

(ERNIE 4.5 runs, `ERNIE_RUNS`: `_paddleformers_ernie.py`.) Each case is one training run of a tiny Llama (`paddleformers.transformers.LlamaForCausalLM`, fp32
weights moved off their init) by `paddleformers.trainer.Trainer` on CPU: AdamW (betas 0.9 / 0.95,
weight decay 0.01 but not on norms, constant lr 1e-2, no grad clipping), `STEPS` steps, then the
Trainer's own save at step `STEPS`. The run is made twice, identically, once per
`save_checkpoint_format`: `flex_checkpoint` (the default: `checkpoint-N/{model_state,
optimizer_state,master_weight}/`) and `unified_checkpoint` (`checkpoint-N/model-*.safetensors`,
`optimizer-*`, `master_weights-*`); the two runs' runtime states must agree bit for bit, so one
reference serves both: `ckpt/flex/` and `ckpt/unified/` are the output folders. The flex
output folder also gets `config.json` from `model.config.save_pretrained` (what `save_model`
writes there; the Trainer writes no config into a flex step folder).

Runs (`RUNS`), a pairwise cover of {untied, tied} x {fp32, bf16 O2 (fp32 master weights)} x {1 rank,
2 ranks} within the corpus budget: untied fp32 and tied bf16 on 1 rank (flex + unified); on 2 ranks
(`paddle.distributed.launch`, gloo) tied fp32 tensor parallel 2 (`tp2`, flex only: PaddleFormers 1.2
cannot write a unified checkpoint under TP, `UNIFIED_TP`), untied bf16 sharding stage1 v2
(`sharding2`, `split_param`, the default: flattened flex pieces; its unified checkpoint holds
per-rank 1-D pieces, `SPLIT`, which the reader refuses) and tied fp32 sharding stage1 v1
(`sharding2v1`, unified only: 2 ranks' whole tensors). What needs shims on CPU is in
`_paddleformers_shims.py` (and every manifest's notes).

References, from Paddle's runtime after the save (rank 0 gathers every rank's
`model.sharded_state_dict()` and `optimizer.sharded_state_dict(...)`, the objects the Trainer
saves, and assembles the global tensors; HF names, HF layouts: the weights the model lists in
`transpose_weight_keys` transposed from Paddle's `[in, out]`, everything else as Paddle holds it):
- `manifest["digests"]`: SHA-256 of each global tensor's bytes (C order, HF layout, the stored
  dtype: bf16 params as their raw 16 bits) for `params`, `master`, `exp_avg`, `exp_avg_sq` (a
  tied model's state under the embedding's name); `manifest["beta_pows"]` (every param's, all
  equal: beta ** (step + 1)) and `steps`;
- `logits` [1, seq, vocab]: a fresh fp32 single-card `LlamaForCausalLM` of the same config loaded
  with the fp32 weights (the masters of a bf16 run), `forward(tokens)`, eval mode; `tokens`;
- `grad:<name>`, `next:<name>`: that model's gradients of its own loss on `NEXT_BATCH` and the
  weights after one step of `paddle.optimizer.AdamW` (the Trainer's hyperparameters and decay
  rule) started from the gathered moments and beta pows (fp32; `hyper` in the manifest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# this file is named like the package it runs: its own folder must not shadow `paddleformers`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
STEPS = 3
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.95), 1e-8
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, fuse_rms_norm=False)
SEQ = 12
TOKENS = np.random.default_rng(7).integers(0, 64, size=(1, SEQ)).astype(np.int64)
NEXT_BATCH = np.random.default_rng(8).integers(0, 64, size=(2, SEQ + 1)).astype(np.int64)
# ckpt/<short> -> save_checkpoint_format
FORMATS = {"flex": "flex_checkpoint", "unified": "unified_checkpoint"}
# a pairwise cover of {untied, tied} x {fp32, bf16 O2 with masters} x {1 rank, 2 ranks}: every pair of
# choices is in some run (the full product is twice the corpus budget)
RUNS = {
    "paddleformers_untied_fp32_1rank": {"tied": False, "prec": "fp32", "par": "1rank", "formats": ["flex", "unified"]},
    "paddleformers_tied_bf16_1rank": {"tied": True, "prec": "bf16", "par": "1rank", "formats": ["flex", "unified"]},
    "paddleformers_tied_fp32_tp2": {"tied": True, "prec": "fp32", "par": "tp2", "formats": ["flex"]},
    "paddleformers_untied_bf16_sharding2": {"tied": False, "prec": "bf16", "par": "sharding2", "formats": ["flex", "unified"]},
    # the unified checkpoint of 2 ranks in whole tensors: sharding stage1 v1 (tp2 cannot write one,
    # v2 writes per-rank pieces)
    "paddleformers_tied_fp32_sharding2v1": {"tied": True, "prec": "fp32", "par": "sharding2v1", "formats": ["unified"]},
}
SPLIT = (
    "ckpt/unified under sharding stage1 v2 (split_param, the default): save_unified_optimizer "
    "gathers the split params only with unified_checkpoint_config 'gather_split_param', which "
    "PaddleFormers 1.2's TrainingArguments refuses ('Found unknown unified_checkpoint config "
    "gather_split_param, accept config is skip_save_model_weight, master_weight_compatible, "
    "async_save, enable_all_options, ignore_merge_optimizer'); so it writes each rank's "
    "optimizer.state_dict(): padded 1-D slices of the moments and masters under the param names, "
    "a param split over both ranks in both files (the index names one of them)"
)
# PaddleFormers 1.2 cannot save a tensor-parallel Llama as a unified checkpoint:
UNIFIED_TP = (
    "no unified checkpoint under tensor parallel: PaddleFormers 1.2's save_unified_checkpoint -> "
    "unified_checkpoint_into_shards -> model.get_tensor_parallel_convert_actions -> "
    "_get_tensor_parallel_mappings raises NotImplementedError (conversion_utils.py:1411; "
    "LlamaForCausalLM defines no TP mappings in 1.2)"
)
PARALLEL = {"1rank": "1 rank", "tp2": "tensor parallel 2 (2 ranks)",
            "sharding2": "sharding stage1 v2 (split_param), 2 ranks",
            "sharding2v1": "sharding stage1 v1 (no split_param), 2 ranks"}
DISTS = ["paddlepaddle", "paddleformers", "numpy", "safetensors", "datasets", "pyarrow"]


# -- the worker: one training run in one process per rank ----------------------------------------


def _training_args(spec, out):
    from paddleformers.trainer import TrainingArguments

    kw = {}
    if spec["prec"] == "bf16":
        kw.update(bf16=True, fp16_opt_level="O2", amp_master_grad=True)
    else:
        kw.update(amp_master_grad=False)
    if spec["par"] == "tp2":
        kw.update(tensor_model_parallel_size=2)
    elif spec["par"] == "sharding2":
        kw.update(sharding="stage1", sharding_parallel_size=2, split_param=True)
    elif spec["par"] == "sharding2v1":
        kw.update(sharding="stage1", sharding_parallel_size=2, split_param=False)
    return TrainingArguments(
        output_dir=out, max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
        adam_epsilon=EPS, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        logging_steps=1, device="cpu", save_checkpoint_format=spec["format"],
        save_rng_states=False, report_to="none", seed=0, disable_tqdm=True, **kw,
    )


def _perturb(model) -> None:
    """Every param off its init, the same global values on any number of ranks: matrices
    N(0, 0.1), vectors 1 + N(0, 0.1), drawn per global tensor and sliced at this rank's offset."""
    sharded = model.sharded_state_dict()
    done = set()
    for i, (key, p) in enumerate(sorted(model.state_dict().items())):
        if id(p) in done:
            continue
        done.add(id(p))
        sw = sharded[key]
        rng = np.random.default_rng(1000 + i)
        shape = tuple(sw.global_shape)
        full = rng.normal(0, 0.1, shape) + (1.0 if len(shape) == 1 else 0.0)
        box = tuple(slice(o, o + n) for o, n in zip(sw.global_offset, p.shape, strict=True))
        p.set_value(full[box].astype(np.float32))


def _pieces(state) -> list:
    """(key, array, dtype name, global shape, global offset, local shape, flattened range) of
    every ShardedWeight (bf16 as raw uint16 bits)."""
    import paddle

    out = []
    for key, sw in state.items():
        t = sw.local_tensor
        dt = "bfloat16" if t.dtype == paddle.bfloat16 else str(t.numpy().dtype)
        arr = t.numpy()  # bf16: its raw uint16 bits
        flat = None
        if getattr(sw, "is_flattened", False):
            r = sw.flattened_range
            flat = (r.start, r.stop) if isinstance(r, slice) else tuple(r)
        out.append((key, np.array(arr), dt, tuple(sw.global_shape), tuple(sw.global_offset),
                    tuple(sw.local_shape), flat))
    return out


def _assemble(all_pieces: list) -> dict:
    """Global arrays from every rank's pieces; every element must be covered."""
    full, seen, dtypes = {}, {}, {}
    for key, arr, dt, gshape, off, lshape, flat in (p for rank in all_pieces for p in rank):
        if key not in full:
            full[key] = np.zeros(gshape, arr.dtype)
            seen[key] = np.zeros(gshape, bool)
            dtypes[key] = dt
        box = tuple(slice(o, o + n) for o, n in zip(off, lshape, strict=True))
        if flat is None:
            full[key][box] = arr.reshape(lshape)
            seen[key][box] = True
        else:
            blk, cov = full[key][box].copy().reshape(-1), seen[key][box].copy().reshape(-1)
            blk[flat[0]:flat[1]] = arr.reshape(-1)
            cov[flat[0]:flat[1]] = True
            full[key][box], seen[key][box] = blk.reshape(lshape), cov.reshape(lshape)
    holes = [k for k, s in seen.items() if not s.all()]
    assert not holes, f"runtime state not covered by the pieces: {holes[:5]}"
    return {k: (v, dtypes[k]) for k, v in full.items()}


def _as_f32(arr, dt):
    if dt == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _next_step(spec, weights, moments, pows, decay):
    """(logits, grads, next weights) of a fresh fp32 single-card model holding `weights`."""
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG, tie_word_embeddings=spec["tied"])
    model = LlamaForCausalLM(cfg)
    sd = model.state_dict()
    names = {id(p): k for k, p in reversed(list(sd.items()))}  # a tied param: its first name
    model.set_state_dict({k: paddle.to_tensor(weights[names[id(p)]]) for k, p in sd.items()})
    model.eval()
    with paddle.no_grad():
        logits = model(paddle.to_tensor(TOKENS))[0].numpy()
    model.train()
    params = {names[id(p)]: p for p in model.parameters()}
    opt = paddle.optimizer.AdamW(
        learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], epsilon=EPS, weight_decay=WD,
        parameters=list(params.values()),
        apply_decay_param_fun=lambda n: n in {p.name for k, p in params.items() if decay(k)},
    )
    state = {}
    for k, p in params.items():
        state[f"{p.name}_moment1_0"] = paddle.to_tensor(moments["exp_avg"][k])
        state[f"{p.name}_moment2_0"] = paddle.to_tensor(moments["exp_avg_sq"][k])
        state[f"{p.name}_beta1_pow_acc_0"] = paddle.to_tensor(np.array([pows[0]], np.float32))
        state[f"{p.name}_beta2_pow_acc_0"] = paddle.to_tensor(np.array([pows[1]], np.float32))
    opt.set_state_dict(state)
    batch = paddle.to_tensor(NEXT_BATCH)
    loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:])[0]
    loss.backward()
    grads = {k: p.grad.numpy().copy() for k, p in params.items()}
    opt.step()
    after = opt.state_dict()
    for k, p in params.items():  # the moments the step used are the ones set
        m1 = after[f"{p.name}_moment1_0"].numpy()
        want = BETAS[0] * moments["exp_avg"][k] + (1 - BETAS[0]) * grads[k]
        assert np.allclose(m1, want, rtol=1e-5, atol=1e-6 * np.abs(want).max()), k
    return logits, grads, {k: p.numpy().copy() for k, p in params.items()}, float(loss)


def _load(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(spec: dict) -> None:
    import paddle

    shims = _load("_paddleformers_shims")
    if spec.get("family"):  # an ERNIE 4.5 run (_paddleformers_ernie.py)
        _load("_paddleformers_ernie").worker(spec, shims, _training_args, _pieces, _assemble, TOKENS)
        return
    if spec["prec"] == "bf16":
        shims.bf16_on_cpu()
    if spec["par"] == "tp2":
        shims.tp_on_cpu()
    if spec["par"] == "sharding2":
        shims.sharding_v2_on_cpu()
    from paddleformers.trainer import Trainer
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    out = spec["out"]
    args = _training_args(spec, out)
    cfg = LlamaConfig(**CONFIG, tie_word_embeddings=spec["tied"],
                      tensor_model_parallel_size=max(args.tensor_model_parallel_size, 1),
                      tensor_parallel_output=False)
    paddle.seed(0)
    model = LlamaForCausalLM(cfg)
    _perturb(model)
    if spec["prec"] == "bf16":
        shims.compute_in_fp32(model)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 64, 16).tolist(), "labels": rng.integers(0, 64, 16).tolist()}
            for _ in range(32)]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    rank = paddle.distributed.get_rank()
    world = paddle.distributed.get_world_size()
    msd = trainer.model.sharded_state_dict()
    pieces = _pieces(msd) + _pieces(trainer.optimizer.sharded_state_dict(msd))
    if world > 1:
        gathered: list = []
        paddle.distributed.all_gather_object(gathered, pieces)
    else:
        gathered = [pieces]
    if rank == 0:
        if spec["format"] == "flex_checkpoint":
            model.config.save_pretrained(out)
        transposed = tuple(f".{m}.weight" for m in LlamaForCausalLM.transpose_weight_keys)
        state = _assemble(gathered)
        decay_names = {p.name for n, p in model.named_parameters()
                       if not any(nd in n for nd in ["bias", "norm"])}
        named = dict(model.named_parameters())
        arrays, meta = {}, {"decay": sorted(n for n, p in named.items() if p.name in decay_names)}
        for key, (arr, dt) in state.items():
            arrays[key] = arr
            meta[key] = dt
        np.savez(os.path.join(spec["runtime"], "state.npz"), **arrays)
        with open(os.path.join(spec["runtime"], "meta.json"), "w") as f:
            json.dump({"dtypes": meta, "transposed": transposed, "decay": meta["decay"],
                       "world": world, "notes": shims.NOTES,
                       "trainer_transpose_keys": list(LlamaForCausalLM.transpose_weight_keys)}, f)
    if world > 1:
        paddle.distributed.barrier()


def next_step_worker(spec: dict) -> None:
    """The fresh-model references (see the module doc) from a run's gathered state."""
    with open(os.path.join(spec["runtime"], "hf.json")) as f:
        hf = json.load(f)
    z = np.load(os.path.join(spec["runtime"], "hf.npz"))
    weights = {k[len("w:"):]: z[k] for k in z.files if k.startswith("w:")}
    moments = {s: {k[len(s) + 1:]: z[k] for k in z.files if k.startswith(s + ":")}
               for s in ("exp_avg", "exp_avg_sq")}
    decay = set(hf["decay"])
    logits, grads, after, loss = _next_step(spec, weights, moments, hf["pows"], lambda k: k in decay)
    np.savez(os.path.join(spec["runtime"], "next.npz"), logits=logits,
             **{f"grad:{k}": v for k, v in grads.items()}, **{f"next:{k}": v for k, v in after.items()})
    with open(os.path.join(spec["runtime"], "next.json"), "w") as f:
        json.dump({"loss": loss}, f)


# -- the parent: runs, checks and writes the cases ------------------------------------------------


def _run(spec: dict, log: str, ranks: int) -> None:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--log_dir", log + ".launch",
               "--nproc_per_node", str(ranks), *cmd[1:]]
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=os.path.dirname(spec["out"]))
    if r.returncode:
        tail = open(log).read()[-3000:]
        for w in sorted(os.listdir(log + ".launch")) if os.path.isdir(log + ".launch") else []:
            if w.startswith("workerlog"):
                tail += f"\n--- {w}\n" + open(os.path.join(log + ".launch", w)).read()[-3000:]
        raise SystemExit(f"paddleformers generator: {spec['format']} run failed ({log}):\n{tail}")


def _hf_state(runtime: str, tied: bool):
    """The gathered runtime state under HF names and layouts (see the module doc)."""
    with open(os.path.join(runtime, "meta.json")) as f:
        meta = json.load(f)
    z = np.load(os.path.join(runtime, "state.npz"))
    dtypes = meta["dtypes"]
    out: dict = {"params": {}, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    pows: dict = {"beta1_pow": set(), "beta2_pow": set()}
    kinds = {".moment1_0": "exp_avg", ".moment2_0": "exp_avg_sq", ".w_0": "master",
             ".beta1_pow_acc_0": "beta1_pow", ".beta2_pow_acc_0": "beta2_pow"}
    for key in z.files:
        kind, name = "params", key
        for suffix, k in kinds.items():
            if key.endswith(suffix):
                kind, name = k, key[: -len(suffix)]
        arr = z[key]
        if kind in pows:
            pows[kind].add(float(arr.reshape(-1)[0]))
            continue
        if name.endswith(tuple(meta["transposed"])):
            arr = np.ascontiguousarray(arr.T)
        out[kind][name] = (arr, dtypes[key])
    emb = "model.embed_tokens.weight"
    if tied:
        for kind, d in out.items():
            if "lm_head.weight" in d:
                head = d.pop("lm_head.weight")
                if emb in d:
                    assert np.array_equal(d[emb][0], head[0]), f"tied {kind}: head != embedding"
                else:
                    d[emb] = head
    assert all(len(v) == 1 for v in pows.values()), pows
    return out, (pows["beta1_pow"].pop(), pows["beta2_pow"].pop()), meta


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


def make_case(out_root: str, case: str, run: dict, tmp: str) -> None:
    import tools

    if run.get("family"):  # an ERNIE 4.5 run (_paddleformers_ernie.py)
        return _load("_paddleformers_ernie").make_case(sys.modules[__name__], out_root, case, run, tmp)
    ranks = 1 if run["par"] == "1rank" else 2
    states = {}
    for short in run["formats"]:
        fmt = FORMATS[short]
        out = os.path.join(tmp, case, short)
        runtime = os.path.join(tmp, case, short + ".runtime")
        os.makedirs(runtime, exist_ok=True)
        spec = {**run, "format": fmt, "out": out, "runtime": runtime}
        _run(spec, os.path.join(tmp, case, short + ".log"), ranks)
        states[short] = (_hf_state(runtime, run["tied"]), spec)
    first = run["formats"][0]
    (a, pows, meta), _ = states[first]
    for other in [s for s in states if s != first]:
        (b, pows_b, _), _ = states[other]
        for kind in a:  # the runs are the same run
            assert sorted(a[kind]) == sorted(b[kind]), kind
            for k in a[kind]:
                assert np.array_equal(a[kind][k][0], b[kind][k][0]), (kind, k)
        assert pows == pows_b
    masters = bool(a["master"])
    fp32 = {k: _as_f32(*(a["master"] if masters else a["params"])[k]) for k in a["params"]}
    runtime = os.path.join(tmp, case, first + ".runtime")
    decay = [k for k in fp32 if not any(nd in k for nd in ["bias", "norm"])]
    with open(os.path.join(runtime, "hf.json"), "w") as f:
        json.dump({"pows": pows, "decay": decay}, f)
    # the fresh model's references take paddle's layout: back to [in, out] for its state dict
    paddle_layout = {k: (v.T.copy() if k.endswith(tuple(meta["transposed"])) else v) for k, v in fp32.items()}
    moments_pl = {s: {k: (a[s][k][0].T.copy() if k.endswith(tuple(meta["transposed"])) else a[s][k][0])
                      for k in a[s]} for s in ("exp_avg", "exp_avg_sq")}
    np.savez(os.path.join(runtime, "hf.npz"), **{f"w:{k}": v for k, v in paddle_layout.items()},
             **{f"{s}:{k}": v for s in moments_pl for k, v in moments_pl[s].items()})
    _run({**run, "format": "next", "out": os.path.join(tmp, case, "next"), "runtime": runtime,
          "next": True}, os.path.join(tmp, case, "next.log"), 1)
    nz = np.load(os.path.join(runtime, "next.npz"))
    with open(os.path.join(runtime, "next.json")) as f:
        loss = json.load(f)["loss"]

    def hf(k, v):
        return np.ascontiguousarray(v.T) if k.endswith(tuple(meta["transposed"])) else v

    refs = {"tokens": TOKENS.astype(np.int32), "next_batch": NEXT_BATCH.astype(np.int32),
            "logits": nz["logits"]}
    for key in nz.files:
        if key.startswith(("grad:", "next:")):
            refs[key] = hf(key.split(":", 1)[1], nz[key])
    case_dir = tools.fresh_case(out_root, case)
    for short in states:
        src = states[short][1]["out"]
        shutil.copytree(src, os.path.join(case_dir, "ckpt", short))
    tools.write_reference(case_dir, refs)
    digests = {kind: {k: {"sha256": _digest(arr), "dtype": dt, "shape": list(arr.shape)}
                      for k, (arr, dt) in d.items()} for kind, d in a.items()}
    what = (f"{'tied' if run['tied'] else 'untied'} Llama, {run['prec']}"
            f"{' O2 with fp32 master weights' if masters else ''}, "
            f"{PARALLEL[run['par']]}")
    tools.record_manifest(
        case_dir,
        tool="PaddleFormers Trainer (paddleformers.trainer.Trainer) on paddlepaddle (CPU, gloo)",
        dists=DISTS,
        command=f"python tests/real/make.py paddleformers --only {case}",
        references={
            "tokens": "[1, seq] int32 ids for the logits",
            "logits": "[1, seq, vocab] fp32: a fresh fp32 LlamaForCausalLM holding the fp32 weights "
                      "(masters in a bf16 run), eval forward of tokens",
            "next_batch": "[2, seq + 1] int32: input_ids = [:, :-1], labels = [:, 1:] of the next step",
            "grad:<name>": "fp32 gradient of that model's loss on next_batch (HF name, HF layout)",
            "next:<name>": "fp32 weight after one paddle.optimizer.AdamW step from the gathered "
                           "moments and beta pows (HF name, HF layout)",
        },
        notes=[*meta["notes"],
               "runtime state gathered from model.sharded_state_dict() and "
               "optimizer.sharded_state_dict() on every rank after the save; digests are of HF "
               "layouts (the model's transpose_weight_keys transposed from Paddle's [in, out])",
               "the flex output folder's config.json is model.config.save_pretrained's",
               *([UNIFIED_TP] if run["par"] == "tp2" else []),
               *([SPLIT] if run["par"] == "sharding2" else [])],
        what=what,
        formats={short: f"ckpt/{short}/checkpoint-{STEPS}" for short in states},
        run=run,
        steps=STEPS,
        hyper={"lr": LR, "weight_decay": WD, "betas": list(BETAS), "eps": EPS,
               "decay": sorted(decay), "no_decay": sorted(set(fp32) - set(decay)),
               "lr_scheduler": "constant", "max_grad_norm": 0.0},
        beta_pows=list(pows),
        next_loss=loss,
        digests=digests,
        transposed=list(meta["transposed"]),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--only", action="append")
    ap.add_argument("--worker")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args(argv)
    if a.worker:
        spec = json.loads(a.worker)
        if spec.get("next"):
            next_step_worker(spec)
        else:
            worker(spec)
        return 0
    tmp = tempfile.mkdtemp(prefix="paddleformers-real-")
    try:
        for case, run in {**RUNS, **_load("_paddleformers_ernie").ERNIE_RUNS}.items():
            if a.only and case not in a.only:
                continue
            print("case", case, flush=True)
            make_case(a.out, case, run, tmp)
    finally:
        if a.keep:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
