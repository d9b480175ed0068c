"""Does torchtitan 0.3 itself resume what `hybridckpt export --to torchtitan --optimizer` writes?

    # in the project venv: import a real torchtitan case (or any source) and export it back
    python -m hybridckpt.cli import tests/real/cases/CASE/ckpt /tmp/x/orbax --config tests/real/cases/CASE/config.json
    python -m hybridckpt.cli export /tmp/x/orbax /tmp/x/ours --to torchtitan --optimizer
    # in the generator's side venv (~/.cache/hybridckpt-real/torchtitan):
    python tests/real/generators/_torchtitan_check_export.py --case CASE --ours /tmp/x/ours --world N [--record F]

WORLD gloo ranks (the case ran on `world_size` in its manifest: use another number) build the
case's model and trainer exactly as the generator did (`torchtitan_parts/titan_rank.build`:
torchtitan's parallelize_fn, OptimizersContainer, LRSchedulersContainer, CheckpointManager), its
checkpoint folder being OURS, and resume through torchtitan's own `CheckpointManager.load()`
(with `exclude_from_loading = ["dataloader"]`: the export writes no data position). Then,
against the references the run took from its own runtime (`reference.safetensors`, HF names
through the model's own `StateDictAdapter.to_hf`):
- every parameter and every AdamW moment bitwise (the moments gathered from the live optimizer,
  keyed by parameter, split by FusedQKVLinear's own hook: one missing would stay at its
  template's zeros and differ), the step, train_state.step and lr_scheduler.last_epoch;
- one optimizer step with the run's next-step gradients (`grad/<hf>`, taken to torchtitan's
  parameters by its own `from_hf` and FusedQKVLinear's merge hook) equals the run's next params
  (`next/<hf>`) within relative 1e-5; the same step with every `step` set to 1 must not (a
  negative control).
Rank 0 prints one line per check and the verdict (exit 1 on a failure); `--record F` writes them,
the versions and the command as JSON (committed under tests/real/export_checks/).

A record (`--record`, with `--export-commands`: the two command lines above as JSON) also pins
the export it is about: those command lines and the folder's digest (`export_digest.py`), taken
before the tool opens it; the tests rerun the command lines and fail while the digest differs.
`python tests/real/rerun_export_checks.py NAME` does all of it for `export_checks/NAME.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import numpy as np
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.join(HERE, "torchtitan_parts"))
sys.path.insert(0, os.path.dirname(HERE))

import titan_shims  # noqa: E402

TOL = 1e-5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference(case_dir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(case_dir, "reference.safetensors"))


def _live(t, model, adapter) -> dict[str, np.ndarray]:
    """params, moments (split by FusedQKVLinear's hook, to_hf) and steps of the live trainer."""
    import titan_rank
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.components.checkpointer.utils import canonical_fqn

    def hf(d):
        return {
            k: v.numpy()
            for k, v in adapter.to_hf({k: titan_rank._full(v) for k, v in d.items()}).items()
        }

    out = {f"param/{k}": v for k, v in hf(ModelWrapper(model).state_dict()).items()}
    (opt,) = t.optimizers.optimizers
    named = {canonical_fqn(n): p for n, p in model.named_parameters()}
    for slot in ("exp_avg", "exp_avg_sq"):
        have = {
            n: titan_rank._full(opt.state[p][slot])
            for n, p in named.items()
            if slot in opt.state.get(p, {})
        }
        out |= {f"{slot}/{k}": v for k, v in hf(titan_rank._split_fused(model, have)).items()}
    out["steps"] = np.array(
        sorted(
            {float(opt.state[p]["step"]) for p in named.values() if "step" in opt.state.get(p, {})}
        )
    )
    return out


def _step_with(
    t, model, adapter, ref: dict, step_override: float | None = None
) -> dict[str, np.ndarray]:
    """One optimizer step with the reference gradients; the params after it (HF names)."""
    import titan_rank
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.models.common.attention import FusedQKVLinear

    grads = adapter.from_hf(
        {
            k[len("grad/") :]: torch.from_numpy(v.copy())
            for k, v in ref.items()
            if k.startswith("grad/")
        }
    )
    for name, mod in model.named_modules():
        if isinstance(mod, FusedQKVLinear):
            FusedQKVLinear._merge_qkv_on_load(mod, grads, canonical_fqn(name) + ".")
    (opt,) = t.optimizers.optimizers
    for n, p in model.named_parameters():
        g = grads[canonical_fqn(n)].to(p.dtype)
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        if step_override is not None:
            opt.state[p]["step"].fill_(step_override)
    t.optimizers.step()
    return {
        f"next/{k}": v.numpy()
        for k, v in adapter.to_hf(
            {k: titan_rank._full(v) for k, v in ModelWrapper(model).state_dict().items()}
        ).items()
    }


def _rank(
    rank: int, world: int, port: int, case_name: str, ours: str, work: str, result: str
) -> None:
    import titan_models
    import titan_rank
    import torch
    import torch.distributed as dist

    titan_shims.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(
            titan_rank.SEED + 99
        )  # (not the run's: everything must come from the load)
        case = titan_models.CASES[case_name]()
        ref = _reference(os.path.join(HERE, "..", "cases", case.name))
        lines, ok = [], True

        def load():
            t, model, adapter = titan_rank.build(case, work)
            t.checkpointer.exclude_from_loading = ["dataloader"]
            assert t.checkpointer.load(), "CheckpointManager.load found no checkpoint"
            return t, model, adapter

        t, model, adapter = load()
        live = _live(t, model, adapter)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            names = sorted(k for k in ref if k.startswith(kind + "/"))
            same = [k for k in names if k in live and np.array_equal(live[k], ref[k])]
            missing = [k for k in names if k not in live]
            good = len(same) == len(names) and not missing
            ok &= good
            lines.append(
                f"{kind}: {len(same)}/{len(names)} bitwise the run's"
                + (f"; missing {missing[:3]}" if missing else "")
            )
        run_step = float(np.asarray(ref["step"]).reshape(-1)[0])  # (stored as [1])
        steps = [float(x) for x in live["steps"]]
        good = (
            steps == [run_step]
            and t.step == int(run_step)
            and t.lr_schedulers.schedulers[0].last_epoch == t.step
        )
        ok &= good
        lines.append(f"optimizer steps {steps}, train_state.step {t.step}, lr_scheduler.last_epoch "
                     f"{t.lr_schedulers.schedulers[0].last_epoch} (run: {run_step})")  # fmt: skip
        after = _step_with(t, model, adapter, ref)
        worst = max(
            float(np.abs(after[k] - ref[k]).max() / np.abs(ref[k]).max()) for k in after if k in ref
        )
        ok &= worst <= TOL
        lines.append(
            f"next step with the run's gradients: max relative difference {worst:.3g} (tolerance {TOL})"
        )
        t.checkpointer.close()
        t, model, adapter = load()
        control = _step_with(t, model, adapter, ref, step_override=1.0)
        worst1 = max(
            float(np.abs(control[k] - ref[k]).max() / np.abs(ref[k]).max())
            for k in control
            if k in ref
        )
        ok &= worst1 > 100 * TOL
        lines.append(
            f"negative control (every step set to 1): max relative difference {worst1:.3g}"
        )
        t.checkpointer.close()
        if rank == 0:
            with open(result, "w") as f:
                json.dump({"ok": bool(ok), "lines": lines}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument(
        "--ours", required=True, help="our export --to torchtitan (a folder holding step-N/)"
    )
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--record", help="write the result as JSON here")
    ap.add_argument("--exported-with", default="", help="the export's options, for the record")
    ap.add_argument("--export-commands", help="the hybridckpt command lines that made OURS (JSON), for the record")
    a = ap.parse_args(argv)
    if a.record and not a.export_commands:
        ap.error("--record needs --export-commands (tests/real/rerun_export_checks.py passes them)")
    import tempfile

    import export_digest

    before = export_digest.digest(a.ours)  # the export as we wrote it, before the tool opens it
    titan_shims.install()
    work = tempfile.mkdtemp(prefix="titan-check-")
    os.symlink(
        os.path.abspath(a.ours), os.path.join(work, "ckpt")
    )  # the trainer's checkpoint.folder
    result = os.path.join(work, "result.json")
    mp.spawn(_rank, args=(a.world, _port(), a.case.removeprefix("torchtitan_"), a.ours, work, result),
             nprocs=a.world, join=True)  # fmt: skip
    with open(result) as f:
        res = json.load(f)
    for line in res["lines"]:
        print(f"{a.case} (world {a.world}): {line}")
    print("RESUMED EXACTLY" if res["ok"] else "DIFFERENT")
    if export_digest.digest(a.ours) != before:
        print(f"{a.ours} changed while torchtitan loaded it: no record")
        return 1
    if a.record:
        import tools

        doc = {"check": "torchtitan CheckpointManager.load of export --to torchtitan --optimizer",
               "case": a.case, "world": a.world, "ok": res["ok"], "lines": res["lines"],
               "exported_with": a.exported_with,
               "export": export_digest.record(json.loads(a.export_commands), a.ours),
               "versions": tools.versions("torchtitan", "torch"),
               "command": f"python tests/real/generators/_torchtitan_check_export.py --case {a.case} --ours OURS "
                          f"--world {a.world}"}  # fmt: skip
        with open(a.record, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
