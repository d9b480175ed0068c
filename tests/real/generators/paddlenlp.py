"""PaddleNLP 3.0.0b4 Trainer checkpoints: the legacy hybrid layout and PaddleNLP's unified checkpoint.

    python tests/real/make.py paddlenlp

PaddleNLP (the predecessor of PaddleFormers; its last release, 3.0.0b4, on paddlepaddle 3.0.0's CPU
wheel) trains a tiny Llama (`paddlenlp.transformers.LlamaForCausalLM`, fp32, weights moved off
their init as in `paddleformers.py`) with `paddlenlp.trainer.Trainer` on CPU: AdamW (betas 0.9 /
0.95, weight decay 0.01 but not on norms, constant lr 1e-2, no clipping), 3 steps, then the
Trainer's own save. Twice, identically: `unified_checkpoint=False` (the default: the legacy
`checkpoint-3/model_state.pdparams` + `optimizer.pdopt`, the README's `paddle` format) and
`unified_checkpoint=True` (`model-*.safetensors` under PaddleNLP's names, `optimizer-*`); the two
runs' states must agree bit for bit. One case, `paddlenlp_untied_fp32_1rank`, `ckpt/legacy/` and
`ckpt/unified/` (a tied, 16-bit or multi-rank PaddleNLP run is not here: the corpus budget).

References from the runtime after the save: `manifest["digests"]` (SHA-256 of every param and
moment in HF names and layouts, by PaddleNLP's own HF mapping `LlamaForCausalLM._get_name_mappings`:
its "transpose" actions), `logits` (the trained model's eval forward of `tokens`), and the
Trainer's own next step: `grad:<name>` of the model's loss on `next_batch` and `next:<name>`
after `trainer.optimizer.step()` (HF names and layouts).
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
# this file is named like the package it runs: its own folder must not shadow `paddlenlp`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
CASE = "paddlenlp_untied_fp32_1rank"
STEPS = 3
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.95), 1e-8
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False, use_flash_attention=False,
              use_fused_rms_norm=False, use_fused_rope=False, architectures=["LlamaForCausalLM"])
SEQ = 12
TOKENS = np.random.default_rng(7).integers(0, 64, size=(1, SEQ)).astype(np.int64)
NEXT_BATCH = np.random.default_rng(8).integers(0, 64, size=(2, SEQ + 1)).astype(np.int64)
FORMATS = {"legacy": False, "unified": True}
DISTS = ["paddlepaddle", "paddlenlp", "numpy", "safetensors", "aistudio-sdk"]


def worker(spec: dict) -> None:
    import paddle
    from paddlenlp.trainer import Trainer, TrainingArguments
    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG)
    paddle.seed(0)
    model = LlamaForCausalLM(cfg)
    for i, (_key, p) in enumerate(sorted(model.state_dict().items())):  # off the init
        rng = np.random.default_rng(1000 + i)
        p.set_value((rng.normal(0, 0.1, p.shape) + (1.0 if len(p.shape) == 1 else 0.0)).astype(np.float32))
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 64, 16).tolist(), "labels": rng.integers(0, 64, 16).tolist()}
            for _ in range(32)]
    args = TrainingArguments(
        output_dir=spec["out"], max_steps=STEPS, save_steps=STEPS, per_device_train_batch_size=2,
        learning_rate=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, logging_steps=1,
        device="cpu", unified_checkpoint=spec["unified"], report_to="none", seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    # PaddleNLP's own HF mapping: structured name -> (HF name, transposed)
    hf = {m.target_name: (m.source_name, m.action == "transpose") for m in LlamaForCausalLM._get_name_mappings(cfg)}
    sd = model.state_dict()
    static = {p.name: k for k, p in sd.items()}
    opt = trainer.optimizer.state_dict()
    out = {}

    def put(kind, key, arr):
        name, transpose = hf[key]
        out[f"{kind}:{name}"] = np.ascontiguousarray(arr.T) if transpose else arr

    for k, p in sd.items():
        put("params", k, p.numpy())
    pows = set()
    for key, t in opt.items():
        if key in ("LR_Scheduler", "master_weights"):
            continue
        pname = next(n for n in sorted(static, key=len, reverse=True) if key.startswith(n + "_"))
        acc = key[len(pname) + 1:]
        if acc.startswith("beta"):
            pows.add((acc, float(t.numpy().reshape(-1)[0])))
        else:
            put({"moment1_0": "exp_avg", "moment2_0": "exp_avg_sq"}[acc], static[pname], t.numpy())
    model.eval()
    with paddle.no_grad():
        out["logits"] = model(paddle.to_tensor(TOKENS))[0].numpy()
    model.train()
    batch = paddle.to_tensor(NEXT_BATCH)
    loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:])[0]
    loss.backward()
    for k, p in sd.items():
        put("grad", k, p.grad.numpy())
    trainer.optimizer.step()
    for k, p in sd.items():
        put("next", k, p.numpy())
    decay = sorted(hf[k][0] for k, p in sd.items() if not any(nd in k for nd in ["bias", "norm"]))
    np.savez(os.path.join(spec["runtime"], "state.npz"), **out)
    with open(os.path.join(spec["runtime"], "meta.json"), "w") as f:
        json.dump({"pows": sorted(pows), "decay": decay, "loss": float(loss),
                   "transposed": sorted(v[0] for v in hf.values() if v[1])}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--worker")
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    sys.path.insert(0, os.path.dirname(HERE))
    import tools

    tmp = tempfile.mkdtemp(prefix="paddlenlp-real-")
    try:
        states = {}
        for short, unified in FORMATS.items():
            spec = {"unified": unified, "out": os.path.join(tmp, short), "runtime": os.path.join(tmp, short + ".rt")}
            os.makedirs(spec["runtime"])
            with open(os.path.join(tmp, short + ".log"), "w") as log:
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            if r.returncode:
                raise SystemExit(f"paddlenlp generator: {short} run failed:\n" + open(log.name).read()[-4000:])
            z = np.load(os.path.join(spec["runtime"], "state.npz"))
            with open(os.path.join(spec["runtime"], "meta.json")) as f:
                states[short] = ({k: z[k] for k in z.files}, json.load(f), spec["out"])
        (a_arr, meta, _), (b_arr, meta_b, _) = states["legacy"], states["unified"]
        assert sorted(a_arr) == sorted(b_arr) and meta["pows"] == meta_b["pows"]
        for k in a_arr:  # the two runs are the same run
            assert np.array_equal(a_arr[k], b_arr[k]), k
        case_dir = tools.fresh_case(a.out, CASE)
        for short, (_, _, out) in states.items():
            shutil.copytree(out, os.path.join(case_dir, "ckpt", short))
        refs = {"tokens": TOKENS.astype(np.int32), "next_batch": NEXT_BATCH.astype(np.int32),
                "logits": a_arr["logits"]}
        refs.update({k: v for k, v in a_arr.items() if k.startswith(("grad:", "next:"))})
        tools.write_reference(case_dir, refs)
        digests: dict = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}, "master": {}}
        for k, v in a_arr.items():
            kind, _, name = k.partition(":")
            if kind in digests:
                digests[kind][name] = {"sha256": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
                                       "dtype": str(v.dtype), "shape": list(v.shape)}
        names = sorted(digests["params"])
        tools.record_manifest(
            case_dir,
            tool="PaddleNLP Trainer (paddlenlp.trainer.Trainer) on paddlepaddle (CPU)",
            dists=DISTS,
            command="python tests/real/make.py paddlenlp",
            references={
                "tokens": "[1, seq] int32 ids for the logits",
                "logits": "[1, seq, vocab] fp32: the trained model's eval forward of tokens",
                "next_batch": "[2, seq + 1] int32: input_ids = [:, :-1], labels = [:, 1:] of the next step",
                "grad:<name>": "fp32 gradient of the model's loss on next_batch (HF name, HF layout)",
                "next:<name>": "fp32 weight after trainer.optimizer.step() (HF name, HF layout)",
            },
            notes=["no shims: PaddleNLP 3.0.0b4's Trainer runs fp32 on one CPU rank as it is",
                   "digests and references in HF names and layouts by LlamaForCausalLM._get_name_mappings"],
            what="untied Llama, fp32, 1 rank; legacy (model_state.pdparams + optimizer.pdopt) and unified",
            formats={short: f"ckpt/{short}/checkpoint-{STEPS}" for short in FORMATS},
            run={"tied": False, "prec": "fp32", "par": "1rank"},
            steps=STEPS,
            hyper={"lr": LR, "weight_decay": WD, "betas": list(BETAS), "eps": EPS,
                   "decay": meta["decay"], "no_decay": sorted(set(names) - set(meta["decay"])),
                   "lr_scheduler": "constant", "max_grad_norm": 0.0},
            beta_pows=meta["pows"],
            next_loss=meta["loss"],
            digests=digests,
            transposed=meta["transposed"],
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
