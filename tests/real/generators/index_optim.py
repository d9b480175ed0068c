"""Optimizer state keyed by parameter INDEX, as the commonest training loops write it (issue 40).

    python tests/real/make.py index_optim [-- --case NAME ...]

`optimizer.state_dict()` of torch keys `state` by the position of each parameter in the
param groups (0, 1, 2, ...) and lists those positions in `param_groups[i]["params"]`; no file
records which name each position is. Each case trains the same tiny `LlamaForCausalLM`
(hf_trainer.py's: fp32, untied, GQA, q/o and k/v of equal shapes, so shapes alone cannot tell
them apart) for 4 AdamW steps and keeps the save of step 3, with weight decay on so the
Trainer's two groups are both non-empty:

- `hf_trainer_index`: transformers' Trainer with its defaults (one process on the CPU, its
  default optimizer and linear schedule, `max_grad_norm` 1.0), `weight_decay=0.1`:
  `checkpoint-3/` with `model.safetensors`, `config.json`, `optimizer.pt` (two groups: the
  decay names of `Trainer.get_decay_parameter_names`, then the rest, each in
  `named_parameters()` order), `scheduler.pt`, `trainer_state.json`, `training_args.bin`,
  `rng_state.pth`.
- `accelerate_index`: a plain accelerate loop (no Trainer), one process,
  `AdamW(model.parameters())` (one group), `accelerator.save_state()` after step 3:
  `model.safetensors`, `optimizer.bin`, `scheduler.bin`, `random_states_0.pkl`.
- `lightning_ckpt_index`: Lightning's `Trainer` (CPU, one process) of a `LightningModule`
  holding the HF model as `self.model`, `configure_optimizers` returning
  `AdamW(self.parameters())` and a per-step LambdaLR; `ModelCheckpoint(every_n_train_steps=3)`
  writes `step=3.ckpt` (`state_dict` under the attribute prefix `model.`, `optimizer_states`,
  `lr_schedulers`, `global_step`, `loops`, ...).
- `lightning_fsdp_sharded`: the same module under `FSDPStrategy(state_dict_type="sharded")` on
  2 CPU gloo ranks (torchrun), two groups by the Trainer's decay rule: the checkpoint is a
  FOLDER `step=3.ckpt/` (torch DCP, `__0_0.distcp`, `__1_0.distcp`, `.metadata`) with
  `meta.pt` beside the shards (Lightning's own state, rank 0).

References (`reference.safetensors`, from the runtime, whole, HF names without any wrapper
prefix): `param/<name>`, `exp_avg/<name>`, `exp_avg_sq/<name>` after step 3, `grad/<name>` the
gradient the fourth optimizer step consumed (after the Trainer's clipping; not for the FSDP
case, whose gradients are sharded flat), `param_next/<name>` after step 4, `tokens` and
`logits` (transformers' forward with the step-3 params). The manifest's `hyper` lists each
param group as torch holds it (hyper-parameters, and `names`: the parameter names in index
order, the truth a reader must recover).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from hf_trainer import HYPER, LLAMA, SEQ, _data, _full, _logits, _model  # noqa: E402

STEPS = 3  # the saved step; the run takes one more
CASES = ("hf_trainer_index", "accelerate_index", "lightning_ckpt_index", "lightning_fsdp_sharded")
DISTS = ["torch", "transformers", "accelerate", "lightning", "safetensors", "numpy"]
WORLD_FSDP = 2
FSDP_SHIM_NOTE = (
    "Lightning 2.6.6 refuses `FSDPStrategy` with `accelerator='cpu'` by an exact type check in "
    "`_AcceleratorConnector._check_strategy_and_fallback` (`type(strategy) is FSDPStrategy`); the generator passes "
    "a subclass with no body (`CPUFSDPStrategy`); Lightning wraps with `device_id=None` on the CPU, which torch's FSDP1 "
    "refuses (`_init_device_handle`: no accelerator), so `torch.distributed.fsdp.FullyShardedDataParallel`, which Lightning imports when it wraps, is a "
    "subclass passing `device_id=torch.device('cpu')` instead; the rest (wrapping, the sharded save through "
    "`save_checkpoint`, `meta.pt`) is Lightning's and torch's own (tests/real/generators/index_optim.py)"
)


class _Refs:
    def __init__(self):
        self.arrays: dict = {}
        self.hyper: list = []
        self.step: list = []


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def _capture(refs: _Refs, kind: str, model, optimizer, prefix: str = "") -> None:
    """Params (or grads) and, for "param", the optimizer's groups and moments, by HF name."""
    named = [(_strip(n, prefix), p) for n, p in model.named_parameters()]
    by_param = {p: n for n, p in named}
    if kind == "param":
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            refs.hyper.append({**{k: v for k, v in group.items() if k != "params"},
                               "names": [by_param[p] for p in group["params"]]})
        for n, p in named:
            st = inner.state[p]
            refs.arrays[f"exp_avg/{n}"] = _full(st["exp_avg"])
            refs.arrays[f"exp_avg_sq/{n}"] = _full(st["exp_avg_sq"])
            refs.step.append(float(st["step"]))
    for n, p in named:
        refs.arrays[f"{kind}/{n}"] = _full(p.grad if kind == "grad" else p)


# -- transformers' Trainer, defaults ------------------------------------------------------------


def _trainer_run(work: str) -> _Refs:
    import transformers

    refs = _Refs()
    args = transformers.TrainingArguments(
        output_dir=work, max_steps=STEPS + 1, save_steps=STEPS, per_device_train_batch_size=2,
        weight_decay=HYPER["weight_decay"], learning_rate=HYPER["learning_rate"], use_cpu=True,
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, logging_steps=1,
    )
    model = _model()
    model.config.save_pretrained(work)

    class Capture(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step in (STEPS, STEPS + 1):
                _capture(refs, "param" if state.global_step == STEPS else "param_next", model, optimizer)

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == STEPS:
                _capture(refs, "grad", model, optimizer)

    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=[Capture()])
    trainer.train()
    return refs


# -- a plain accelerate loop -----------------------------------------------------------------


def _accelerate_run(work: str) -> _Refs:
    import torch
    from accelerate import Accelerator

    refs = _Refs()
    acc = Accelerator(cpu=True)
    model = _model()
    h = HYPER
    opt = torch.optim.AdamW(model.parameters(), lr=h["learning_rate"], betas=(h["adam_beta1"], h["adam_beta2"]),
                            eps=h["adam_epsilon"], weight_decay=h["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = _data()
    model, opt, sched = acc.prepare(model, opt, sched)
    for step in range(STEPS + 1):
        ids = torch.stack([r["input_ids"] for r in data[step * 2:step * 2 + 2]])
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        if step == STEPS:
            _capture(refs, "grad", model, opt)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step == STEPS - 1:
            _capture(refs, "param", model, opt)
            acc.save_state(os.path.join(work, f"checkpoint-{STEPS}"))
    _capture(refs, "param_next", model, opt)
    _model().config.save_pretrained(work)
    return refs


# -- Lightning ---------------------------------------------------------------------------------


def _decay_split(named):
    """The Trainer's rule (transformers 5.24 `get_decay_parameter_names`): no decay for biases
    and norm weights."""
    import re

    forbidden = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decay = [p for n, p in named if not any(re.search(f, n.lower()) for f in forbidden)]
    rest = [p for n, p in named if any(re.search(f, n.lower()) for f in forbidden)]
    return decay, rest


def _lightning_run(case: str, work: str) -> _Refs:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    refs = _Refs()
    fsdp = case == "lightning_fsdp_sharded"
    h = HYPER

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            kw = dict(lr=h["learning_rate"], betas=(h["adam_beta1"], h["adam_beta2"]), eps=h["adam_epsilon"])
            if fsdp:
                decay, rest = _decay_split([(_strip(n, "model."), p) for n, p in self.named_parameters()])
                opt = torch.optim.AdamW([{"params": decay, "weight_decay": h["weight_decay"]},
                                         {"params": rest, "weight_decay": 0.0}], **kw)
            else:
                opt = torch.optim.AdamW(self.parameters(), weight_decay=h["weight_decay"], **kw)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Capture(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == STEPS and not fsdp:
                _capture(refs, "grad", module, optimizer, prefix="model.")

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if trainer.global_step in (STEPS, STEPS + 1):
                kind = "param" if trainer.global_step == STEPS else "param_next"
                if fsdp:
                    _capture_fsdp(refs, kind, trainer.model, trainer.optimizers[0])
                else:
                    _capture(refs, kind, module, trainer.optimizers[0], prefix="model.")

    ids = torch.stack([r["input_ids"] for r in _data()])
    rank = int(os.environ.get("RANK", "0"))
    world = WORLD_FSDP if fsdp else 1
    # each rank its own rows of every step (Lightning's sampler would also split; explicit here)
    mine = [ids[(s * world + rank) * 2:(s * world + rank) * 2 + 2] for s in range(STEPS + 1)]
    loader = DataLoader(mine, batch_size=None, shuffle=False)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(work, "checkpoints"), every_n_train_steps=STEPS,
                                                  save_top_k=-1, filename="{step}", save_last=False)
    strategy = "auto"
    if fsdp:
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        class CPUFSDPStrategy(FSDPStrategy):
            """FSDP_SHIM_NOTE: the strategy itself, unchanged."""

        import torch.distributed.fsdp as torch_fsdp

        class CPUFSDP(torch_fsdp.FullyShardedDataParallel):
            """FSDP_SHIM_NOTE: FSDP1 given the CPU as its device (Lightning passes None there)."""

            def __init__(self, *a, device_id=None, **kw):
                super().__init__(*a, device_id=torch.device("cpu") if device_id is None else device_id, **kw)

        torch_fsdp.FullyShardedDataParallel = CPUFSDP  # Lightning imports it from here when it wraps

        strategy = CPUFSDPStrategy(state_dict_type="sharded", auto_wrap_policy={LlamaDecoderLayer})
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS + 1,
                        callbacks=[Capture(), ckpt_cb], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False, deterministic=True)
    trainer.fit(Lit(), loader)
    if rank == 0:
        _model().config.save_pretrained(work)
    return refs


def _capture_fsdp(refs: _Refs, kind: str, model, optimizer) -> None:
    """Whole params and moments of an FSDP model, by HF name (torch's state_dict API)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)  # (cpu_offload=True segfaults in FSDP1 on the CPU)
    msd = get_model_state_dict(model, options=opts)
    names = [n for n in msd]
    key = "param" if kind == "param" else "param_next"
    for n in names:
        refs.arrays[f"{key}/{_strip(n, 'model.')}"] = msd[n].detach().float().clone()
    if kind == "param":
        osd = get_optimizer_state_dict(model, optimizer, options=opts)
        for n, st in osd["state"].items():
            hf = _strip(n, "model.")
            refs.arrays[f"exp_avg/{hf}"] = st["exp_avg"].detach().float().clone()
            refs.arrays[f"exp_avg_sq/{hf}"] = st["exp_avg_sq"].detach().float().clone()
            refs.step.append(float(st["step"]))
        for group in osd["param_groups"]:
            refs.hyper.append({**{k: v for k, v in group.items() if k != "params"},
                               "names": [_strip(n, "model.") for n in group["params"]]})


# -- the driver ---------------------------------------------------------------------------------


def worker(case: str, work: str) -> None:
    import torch

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    if case == "hf_trainer_index":
        refs = _trainer_run(work)
    elif case == "accelerate_index":
        refs = _accelerate_run(work)
    else:
        refs = _lightning_run(case, work)
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in refs.arrays.items()}, os.path.join(work, "refs.safetensors"))
        with open(os.path.join(work, "refs.json"), "w") as f:
            json.dump({"hyper": refs.hyper, "step": sorted(set(refs.step))}, f, default=str)


def _write_case(out: str, case: str, keep: str, work: str, notes: list[str]) -> None:
    import tools
    from safetensors.torch import load_file

    case_dir = tools.fresh_case(out, case)
    shutil.copytree(keep, os.path.join(case_dir, "ckpt"), symlinks=False)
    arrays = load_file(os.path.join(work, "refs.safetensors"))
    with open(os.path.join(work, "refs.json")) as f:
        info = json.load(f)
    params = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    tokens, logits = _logits(params)
    arrays |= {"tokens": tokens, "logits": logits}
    refs = {
        "param/<name>": "every parameter after step 3 as the runtime holds it, whole (HF names)",
        "exp_avg/<name>, exp_avg_sq/<name>": "the AdamW moments after step 3, whole, by HF name",
        "param_next/<name>": "every parameter after the fourth step",
        "tokens": "[2, 8] fixed tokens",
        "logits": "[2, 8, 32] LlamaForCausalLM (transformers, eager, fp32) with param/<name>",
    }
    if any(k.startswith("grad/") for k in arrays):
        refs["grad/<name>"] = "the gradient the fourth optimizer step consumed (after any clipping), whole"
    tools.write_reference(case_dir, {k: v.numpy() for k, v in arrays.items()})
    tools.record_manifest(
        case_dir, tool="transformers Trainer / accelerate / Lightning, optimizer state keyed by index", dists=DISTS,
        command=f"python tests/real/make.py index_optim -- --case {case}", references=refs, notes=notes,
        hyper=info["hyper"], optimizer_step=info["step"], llama=LLAMA, seq=SEQ,
        named_parameters=[n for n, _ in _model().named_parameters()],  # transformers' module order
        world=WORLD_FSDP if case == "lightning_fsdp_sharded" else 1,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--case", action="append", choices=CASES)
    ap.add_argument("--worker")
    ap.add_argument("--work")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.work)
        return 0
    sys.path.insert(0, os.path.dirname(HERE))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    root = tempfile.mkdtemp(prefix="index_optim_")
    for case in a.case or list(CASES):
        work = os.path.join(root, case)
        os.makedirs(work)
        nproc = WORLD_FSDP if case == "lightning_fsdp_sharded" else 1
        launch = [sys.executable]  # one process: `python train.py`, as a user runs it (no torch.distributed)
        if nproc > 1:
            launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                       str(29700 + CASES.index(case))]
        cmd = [*launch, os.path.abspath(__file__), "--worker", case, "--work", work]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)
        keep = tempfile.mkdtemp(prefix="keep_", dir=root)
        shutil.copy(os.path.join(work, "config.json"), keep)
        notes = []
        if case == "lightning_fsdp_sharded":
            notes.append(FSDP_SHIM_NOTE)
        if case.startswith("lightning"):
            name = f"step={STEPS}.ckpt"
            src = os.path.join(work, "checkpoints", name)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(keep, name))
            notes.append("the run's output folder: the checkpoint Lightning's ModelCheckpoint wrote after step 3, and "
                         "config.json saved by the training script beside it (Lightning does not write one)")
        else:
            shutil.copytree(os.path.join(work, f"checkpoint-{STEPS}"), os.path.join(keep, f"checkpoint-{STEPS}"))
            notes.append("the output folder as the run left it, less checkpoint-4 (the step after, which the references "
                         "describe) and the final save; config.json saved there by the training script")
        _write_case(a.out, case, keep, work, notes)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
