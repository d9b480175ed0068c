"""Does Megatron-LM itself load what `hybridckpt export --to megatron --optimizer` writes, at
another tp/pp, and take the same step?

    # in the project venv: import the real dense case and export it for another layout
    python -m hybridckpt.cli import tests/real/cases/megatron_core_dense_fully_reshardable/ckpt /tmp/x/orbax
    python -m hybridckpt.cli export /tmp/x/orbax /tmp/x/ours --to megatron --optimizer --tp 2 --pp 2
    # in the generator's side venv (~/.cache/hybridckpt-real/megatron_core):
    python tests/real/generators/_megatron_core_check_export.py --ours /tmp/x/ours [--record F]

One rank (tp = pp = 1: another layout than the export's chunks, and than the run's tp2 pp2 dp2)
builds the dense case's model and optimizer with Megatron-LM's own code and arguments
(`megatron_core.py` COMMON, `_megatron_core_run._setup`: `setup_model_and_optimizer`, then
`load_checkpoint` with `--load OURS`: megatron-core's resharding load of the `fully_reshardable`
state). Then, against the references the run took from its own runtime (reference.safetensors of
megatron_core_dense_dp_reshardable, megatron-core names):
- every parameter, every fp32 master and Adam moment (`_get_main_param_and_optimizer_states`)
  bitwise the run's on the model's rows; the padded vocabulary rows (60..63: Megatron-internal,
  not part of the HF model our import keeps) are zero in ours, said apart;
- GPTModel's own forward on the run's fixed tokens: its logits on the model's 60 vocabulary
  columns equal the run's (relative 1e-5);
- the optimizer step: the run's next-step gradients put into the params' `main_grad` and
  Megatron's `DistributedOptimizer.step()` taken: the params after it equal the run's next params
  (`param_next`) within relative 1e-5 on the model's rows; from every `step` set to 1 instead (a
  negative control) they must not;
- for information, Megatron's own `train_step` on the run's next batch from the loaded state:
  its loss normalises over the padded vocabulary too, whose rows the HF model does not carry, so
  it differs from the run's by that much (printed, not a pass condition).
Prints one line per check and the verdict (exit 1 on a failure); `--record F` writes them as
JSON (committed under tests/real/export_checks/).

A record (`--record`, with `--export-commands`: the two command lines above as JSON) also pins
the export it is about: those command lines and the folder's digest (`export_digest.py`), taken
before the tool opens it; the tests rerun the command lines and fail while the digest differs.
`python tests/real/rerun_export_checks.py NAME` does all of it for `export_checks/NAME.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # tools.py
CASE = "megatron_core_dense_dp_reshardable"  # holds the dense state's references
VOCAB = 60
TOL = 1e-5


def _rows(name: str, a):
    return a[:VOCAB] if name in ("embedding.word_embeddings.weight", "output_layer.weight") else a


def _check(ours: str, result: str) -> None:
    """Under torchrun (one rank): load, compare, step; rank 0 writes `result`."""
    import _megatron_core_run as run
    import megatron_core as gen
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    ref = load_file(os.path.join(HERE, "..", "cases", CASE, "reference.safetensors"))
    argv = [*gen.COMMON, *gen.SINGLE, "--load", ours, "--exit-on-missing-checkpoint"]
    model, optimizer, scheduler = run._setup(argv)
    from megatron.training import get_args

    args = get_args()
    params = run._named(model)
    owned = run._owned(optimizer, params)
    lines, ok = [], True

    def compare(kind: str, got: dict) -> None:
        nonlocal ok
        names = sorted(k[len(kind) + 1 :] for k in ref if k.startswith(kind + "/"))
        same = [n for n in names if n in got and np.array_equal(_rows(n, got[n]), _rows(n, ref[f"{kind}/{n}"]))]
        padded = [n for n in names if n in got and _rows(n, got[n]) is not got[n]]
        zero = all(not np.any(got[n][VOCAB:]) for n in padded)
        ok &= len(same) == len(names) and zero
        lines.append(f"{kind}: {len(same)}/{len(names)} bitwise the run's on the model's rows; padded vocab rows "
                     f"{'zero' if zero else 'NOT zero'} in {len(padded)} tensors")  # fmt: skip

    compare("param", {n: p.detach().numpy().copy() for n, p in params.items()})
    states = {n: o._get_main_param_and_optimizer_states(params[n]) for n, (o, _, _) in owned.items()}
    for slot in ("exp_avg", "exp_avg_sq"):
        compare(slot, {n: st[slot].detach().reshape(params[n].shape).numpy().copy() for n, st in states.items()})
    masters = {n: st["param"].detach().reshape(params[n].shape).numpy() for n, st in states.items()}
    same = all(np.array_equal(_rows(n, m), _rows(n, ref[f"param/{n}"])) for n, m in masters.items())
    ok &= same and len(masters) == len(params)
    lines.append(f"fp32 masters: {len(masters)} of {len(params)} params, {'bitwise' if same else 'DIFFERENT'} the run's")
    steps = sorted({float(st["step"]) for o in run._optimizers(optimizer) for st in o.optimizer.state.values()})
    ok &= steps == [3.0] and args.iteration == 3
    lines.append(f"optimizer steps {steps}, iteration {args.iteration} (run: 3)")

    fixed = run.batch(10_000, 0, 0, 2, args.seq_length, args.vocab_size)
    assert np.array_equal(fixed["tokens"].numpy(), ref["tokens"])
    for m in model:
        m.eval()
    with torch.no_grad():
        logits = model[0](fixed["tokens"], fixed["position_ids"], fixed["attention_mask"]).float().numpy()
    for m in model:
        m.train()
    want = ref["logits"][..., :VOCAB]
    lw = float(np.abs(logits[..., :VOCAB] - want).max() / np.abs(want).max())
    ok &= lw <= TOL
    lines.append(f"GPTModel's logits on the run's fixed tokens, the model's {VOCAB} vocabulary columns: max relative "
                 f"difference {lw:.3g} (tolerance {TOL})")  # fmt: skip

    inner = [o.optimizer for o in run._optimizers(optimizer)]
    snapshot = ({n: p.detach().clone() for n, p in params.items()},
                [{id(p): {k: v.clone() for k, v in o.state[p].items()} for g in o.param_groups for p in g["params"]}
                 for o in inner],
                [[p.detach().clone() for g in o.param_groups for p in g["params"]] for o in inner])  # fmt: skip

    def restore() -> None:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(snapshot[0][n])
            for o, st, mains in zip(inner, snapshot[1], snapshot[2], strict=True):
                for p, saved in zip([p for g in o.param_groups for p in g["params"]], mains, strict=True):
                    p.copy_(saved)
                    for k, v in st[id(p)].items():
                        o.state[p][k] = v.clone()

    def worst(after: dict) -> float:
        return max(float(np.abs(_rows(n, after[n]) - _rows(n, ref[f"param_next/{n}"])).max()
                         / np.abs(_rows(n, ref[f"param_next/{n}"])).max()) for n in after)  # fmt: skip

    def injected_step(step_to: float | None) -> dict:
        restore()
        if step_to is not None:
            for o in inner:
                for st in o.state.values():
                    st["step"].fill_(step_to)
        for n, p in params.items():
            p.main_grad.copy_(torch.from_numpy(ref[f"grad/{n}"].copy()).reshape(p.shape))
        optimizer.step()
        return {n: p.detach().numpy().copy() for n, p in params.items()}

    w = worst(injected_step(None))
    ok &= w <= TOL
    lines.append(f"Megatron's optimizer step with the run's gradients: max relative difference {w:.3g} (tolerance {TOL})")
    w1 = worst(injected_step(1.0))
    ok &= w1 > 100 * TOL
    lines.append(f"negative control (every step set to 1): max relative difference {w1:.3g}")
    restore()
    run._train_step(model, optimizer, scheduler, args.iteration)
    w2 = worst({n: p.detach().numpy().copy() for n, p in params.items()})
    lines.append(f"(information) Megatron's own train_step on the run's next batch: max relative difference {w2:.3g} "
                 f"(its loss normalises over the padded vocabulary rows too, which the HF model does not carry)")  # fmt: skip
    if torch.distributed.get_rank() == 0:
        with open(result, "w") as f:
            json.dump({"ok": bool(ok), "lines": lines}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="our export --to megatron (a folder holding iter_N/)")
    ap.add_argument("--record", help="write the result as JSON here")
    ap.add_argument("--exported-with", default="", help="the export's options, for the record (e.g. '--tp 2 --pp 2')")
    ap.add_argument("--export-commands", help="the hybridckpt command lines that made OURS (JSON), for the record")
    ap.add_argument("--under-torchrun", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.record and not a.export_commands and not a.under_torchrun:
        ap.error("--record needs --export-commands (tests/real/rerun_export_checks.py passes them)")
    if a.under_torchrun:
        import _megatron_core_shims as shims

        shims.install()
        import torch

        _check(os.path.abspath(a.ours), a.under_torchrun)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return 0
    import tempfile

    import export_digest

    before = export_digest.digest(a.ours)  # the export as we wrote it, before Megatron opens it
    result = os.path.join(tempfile.mkdtemp(prefix="megatron-check-"), "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port=29519",
           os.path.abspath(__file__), "--ours", a.ours, "--under-torchrun", result]  # fmt: skip
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if r.returncode or not os.path.exists(result):
        print(r.stdout[-4000:], r.stderr[-8000:])
        return 1
    with open(result) as f:
        res = json.load(f)
    for line in res["lines"]:
        print(f"{CASE} (loaded at tp1 pp1): {line}")
    print("LOADED AND STEPPED EXACTLY" if res["ok"] else "DIFFERENT")
    if export_digest.digest(a.ours) != before:
        print(f"{a.ours} changed while Megatron loaded it: no record")
        return 1
    if a.record:
        import tools

        doc = {"check": "Megatron-LM load_checkpoint of export --to megatron --optimizer, then its optimizer step",
               "case": CASE, "loaded_at": {"tp": 1, "pp": 1}, "exported_with": a.exported_with, "ok": res["ok"],
               "export": export_digest.record(json.loads(a.export_commands), a.ours),
               "lines": res["lines"],
               "versions": tools.versions("megatron-core", "torch"),
               "command": "python tests/real/generators/_megatron_core_check_export.py --ours OURS"}  # fmt: skip
        with open(a.record, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
