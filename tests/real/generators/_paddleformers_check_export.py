"""Does PaddleFormers itself load what `hybridckpt export --to paddleformers-unified` writes?

    # in the project venv: import a real unified case and export it back
    python -m hybridckpt.cli import tests/real/cases/CASE/ckpt/unified/checkpoint-3 /tmp/x/orbax
    python -m hybridckpt.cli export /tmp/x/orbax /tmp/x/ours --optimizer --to paddleformers-unified [--dtype bfloat16]
    # in the generator's side venv (~/.cache/hybridckpt-real/paddleformers):
    python tests/real/generators/_paddleformers_check_export.py --case CASE --ours /tmp/x/ours

One process, one rank: the case's model and Trainer are built as the generator built them
(`paddleformers.py`: config, bf16 O2 shims for a bf16 run), then PaddleFormers' own resume path
loads each folder in turn, the Trainer's real unified checkpoint and ours:
`UnifiedCheckpointHandler.load_unified_checkpoint(model, dir, convert_from_hf=args.convert_from_hf)`
(the model params) and `load_unified_optimizer(model, optimizer, dir)` (the optimizer state dict the
Trainer hands to `optimizer.set_state_dict`). Every loaded param, moment and master must be
bit-identical between the two; the beta pows within 1 ulp (Paddle multiplies them up step by step,
the export computes beta ** (step + 1)). Prints one line per folder and the verdict; exit 1 on a
difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def _generator():
    spec = importlib.util.spec_from_file_location("_pf_generator", os.path.join(HERE, "paddleformers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _numpy(t) -> np.ndarray:
    return np.array(t.numpy())  # bf16: its raw uint16 bits


def load(trainer, folder: str) -> dict[str, np.ndarray]:
    """What PaddleFormers' resume loads from `folder`, by structured name."""
    handler = trainer.unified_checkpoint_handler
    model = trainer.model
    handler.load_unified_checkpoint(model, folder, convert_from_hf=trainer.args.convert_from_hf)
    out = {f"param:{k}": _numpy(v) for k, v in model.state_dict().items()}
    static = {v.name: k for k, v in model.state_dict().items()}
    opt = handler.load_unified_optimizer(model, trainer.optimizer, folder)
    for key, t in opt.items():
        if key == "master_weights":
            out.update({f"master:{static[n]}": _numpy(v) for n, v in t.items()})
        elif key != "LR_Scheduler":
            name = next(n for n in sorted(static, key=len, reverse=True) if key.startswith(n + "_"))
            out[f"opt:{static[name]}:{key[len(name) + 1:]}"] = _numpy(t)
    return out


def against_digests(case: str, ours: dict, m: dict) -> int:
    """What PaddleFormers loaded from our export against the run's runtime digests (HF layouts:
    the transposed weights' state turned back)."""
    import hashlib

    transposed = tuple(m["transposed"])
    kinds = {"param": "params", "master": "master", "opt:moment1_0": "exp_avg", "opt:moment2_0": "exp_avg_sq"}
    bad, seen = [], 0
    for key, arr in ours.items():
        kind, name = key.split(":")[0], key.split(":")[1]
        if kind == "opt":
            kind = "opt:" + key.split(":")[2]
        want = m["digests"].get(kinds.get(kind, ""), {}).get(name)
        if want is None:
            continue
        hf = np.ascontiguousarray(arr.T) if name.endswith(transposed) else arr
        seen += 1
        if hashlib.sha256(hf.tobytes()).hexdigest() != want["sha256"]:
            bad.append(key)
    print(f"{case}: PaddleFormers loaded {len(ours)} tensors from ours; {seen} checked against the run's digests")
    print("identical to the run" if not bad and seen else f"DIFFERENT: {bad[:10]}")
    return 1 if bad or not seen else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--ours", required=True, help="our export --to paddleformers-unified")
    ap.add_argument("--cases", default=os.path.join(os.path.dirname(HERE), "cases"))
    a = ap.parse_args(argv)
    gen = _generator()
    with open(os.path.join(a.cases, a.case, "manifest.json")) as f:
        m = json.load(f)
    run = {**m["run"], "par": "1rank"}
    import paddle

    shims = gen._shims()
    if run["prec"] == "bf16":
        shims.bf16_on_cpu()
    from paddleformers.trainer import Trainer
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    spec = {**run, "format": "unified_checkpoint", "out": os.path.join(a.ours, "..", "check-run")}
    args = gen._training_args(spec, spec["out"])
    paddle.seed(0)
    model = LlamaForCausalLM(LlamaConfig(**gen.CONFIG, tie_word_embeddings=run["tied"]))
    trainer = Trainer(model=model, args=args, train_dataset=[])
    trainer.create_optimizer_and_scheduler(num_training_steps=gen.STEPS)
    try:
        theirs = load(trainer, os.path.join(a.cases, a.case, "ckpt", "unified", f"checkpoint-{gen.STEPS}"))
    except Exception as e:  # noqa: BLE001 - reported, then ours is checked against the digests
        print(f"{a.case}: PaddleFormers cannot load its own checkpoint on one rank: {type(e).__name__}: {e}")
        theirs = None
    ours = load(trainer, a.ours)
    if theirs is None:
        return against_digests(a.case, ours, m)
    print(f"{a.case}: PaddleFormers loaded {len(theirs)} tensors from its own checkpoint, {len(ours)} from ours")
    bad = sorted(set(theirs) ^ set(ours))
    for k in sorted(set(theirs) & set(ours)):
        x, y = theirs[k], ours[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append(f"{k}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        elif "_pow_acc_" in k:
            if np.abs(x.view(np.int32).astype(np.int64) - y.view(np.int32).astype(np.int64)).max() > 1:
                bad.append(f"{k}: {x} vs {y}")
        elif not np.array_equal(x.view(np.uint8), y.view(np.uint8)):
            bad.append(k)
    print("identical (beta pows within 1 ulp)" if not bad else f"DIFFERENT: {bad[:10]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
