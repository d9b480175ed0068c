"""Does transformers' Trainer itself resume what `hybridckpt export --to hf --optimizer
--optimizer-layout trainer` writes, with the moments?

    # in the project venv: hf_trainer_index's state after step 3 (the Trainer's runtime params and
    # AdamW moments by name, reference.safetensors) as our HF layout, then exported for the Trainer
    python tests/real/generators/_trainer_check_export.py --source /tmp/x/src
    python -m hybridckpt.cli export /tmp/x/src /tmp/x/ours --optimizer --optimizer-layout trainer
    # in the generator's side venv (~/.cache/hybridckpt-real/index_optim: transformers 5.24.0,
    # accelerate 1.15.0, torch 2.13.0 CPU):
    python tests/real/generators/_trainer_check_export.py --ours /tmp/x/ours [--record F]

The side venv runs the case's own Trainer set-up again (index_optim.py `_trainer_run`: the same
model, data, seeds and TrainingArguments, `max_steps=4`) with
`trainer.train(resume_from_checkpoint=OURS)`: the Trainer's own `_load_from_checkpoint`,
`create_optimizer`, `_load_optimizer_and_scheduler`, `TrainerState.load_from_json` and batch
skipping. A callback checks, before its first optimizer step after the resume, that:
- the resumed global_step is 3, every AdamW `step` 3.0, each group's lr and weight_decay;
- every parameter and both AdamW moments are bitwise the run's (`param/`, `exp_avg/`,
  `exp_avg_sq/` by name through the live model's `named_parameters()`);
- the gradient is bitwise the run's fourth (`grad/`: the same batch after skipping three);
and after the step, every parameter bitwise the run's own fourth step (`param_next/`). One line
per check and the verdict (exit 1 on a failure); `--record F` writes them with the versions,
the command and the SHA-256 of the files resumed (the test rebuilds our export and compares).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = "hf_trainer_index"
CASE_DIR = os.path.join(os.path.dirname(HERE), "cases", CASE)
FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")
SLOTS = ("exp_avg", "exp_avg_sq")


def source_folder(out: str) -> None:
    """(project venv) The Trainer's state after step 3, from its runtime (`reference.safetensors`,
    the manifest's group 0 hyper-parameters), written as our HF layout at `out`."""
    from safetensors.numpy import load_file

    from hybridckpt.formats.hf.write import write_hf
    from hybridckpt.lazy import ArrayTensor

    ref = load_file(os.path.join(CASE_DIR, "reference.safetensors"))
    with open(os.path.join(CASE_DIR, "manifest.json")) as f:
        man = json.load(f)
    with open(os.path.join(CASE_DIR, "ckpt", "checkpoint-3", "config.json")) as f:
        config = json.load(f)
    names, g0 = man["named_parameters"], man["hyper"][0]
    hyper = {k: g0[k] for k in ("lr", "betas", "eps", "weight_decay", "initial_lr", "fused", "foreach")}
    write_hf(out, {n: ArrayTensor(ref[f"param/{n}"]) for n in names}, config,
             slots={s: {n: ArrayTensor(ref[f"{s}/{n}"]) for n in names} for s in SLOTS}, step=3,
             trainer={"step": 3, "source_format": "hf-trainer", "optimizer_name": "adamw", "optimizer": hyper})


def digests(folder: str) -> dict[str, str]:
    out = {}
    for name in FILES:
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _check(ours: str) -> tuple[list[str], bool]:  # (side venv)
    import numpy as np
    import transformers
    from safetensors.numpy import load_file

    sys.path.insert(0, HERE)
    from hf_trainer import HYPER, _data, _model
    from index_optim import STEPS

    ref = load_file(os.path.join(CASE_DIR, "reference.safetensors"))
    lines: list[str] = []
    fails: list[str] = []

    def say(ok: bool, text: str) -> None:
        lines.append(text)
        if not ok:
            fails.append(text)

    def bitwise(kind: str, got: dict) -> None:
        bad = [n for n, a in got.items() if not np.array_equal(a, ref[f"{kind}/{n}"])]
        say(not bad, f"{kind}: {len(got) - len(bad)}/{len(got)} bitwise the run's" + (f" (not: {bad[:3]})" if bad else ""))

    seen = {"before": False, "after": False}

    class Check(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if seen["before"]:
                return
            seen["before"] = True
            inner = getattr(optimizer, "optimizer", optimizer)
            named = list(model.named_parameters())
            steps = sorted({float(inner.state[p]["step"]) for _, p in named})
            groups = [(g["lr"], g["weight_decay"], len(g["params"])) for g in inner.param_groups]
            say(state.global_step == STEPS and steps == [float(STEPS)],
                f"resumed at global_step {state.global_step}, AdamW steps {steps} (run: {STEPS})")
            want = [(h["lr"], h["weight_decay"], len(h["names"])) for h in _manifest()["hyper"]]
            say(groups == want, f"param groups (lr, weight_decay, size) {groups} (run: {want})")
            bitwise("param", {n: p.detach().numpy().copy() for n, p in named})
            for s in SLOTS:
                bitwise(s, {n: inner.state[p][s].numpy().copy() for n, p in named})
            bitwise("grad", {n: p.grad.numpy().copy() for n, p in named})

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == STEPS + 1:
                seen["after"] = True
                bitwise("param_next", {n: p.detach().numpy().copy() for n, p in model.named_parameters()})

    with tempfile.TemporaryDirectory() as work:
        args = transformers.TrainingArguments(
            output_dir=work, max_steps=STEPS + 1, save_steps=STEPS, per_device_train_batch_size=2,
            weight_decay=HYPER["weight_decay"], learning_rate=HYPER["learning_rate"], use_cpu=True,
            report_to=[], seed=0, data_seed=0, disable_tqdm=True, logging_steps=1, save_strategy="no",
        )
        trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data(), callbacks=[Check()])
        trainer.train(resume_from_checkpoint=ours)
    say(seen["before"] and seen["after"], f"one optimizer step taken after the resume: {seen}")
    return lines, not fails


def _manifest() -> dict:
    with open(os.path.join(CASE_DIR, "manifest.json")) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", help="(project venv) write the export's source folder here and stop")
    ap.add_argument("--ours", help="(side venv) our export of --source, --optimizer-layout trainer")
    ap.add_argument("--record", help="write the results as JSON here")
    a = ap.parse_args()
    if a.source:
        source_folder(a.source)
        return 0
    import accelerate
    import torch
    import transformers

    lines, ok = _check(a.ours)
    for x in lines:
        print(x)
    print("OK" if ok else "FAILED")
    if a.record:
        doc = {"case": CASE, "check": "transformers Trainer.train(resume_from_checkpoint=OURS) of export --to hf "
               "--optimizer --optimizer-layout trainer", "command": "python tests/real/generators/"
               "_trainer_check_export.py --ours OURS", "lines": lines, "ok": ok, "files": digests(a.ours),
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "accelerate": accelerate.__version__}}
        with open(a.record, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
