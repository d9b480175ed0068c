"""Training folders as transformers' Trainer and accelerate write them, and DeepSpeed's universal
checkpoint of one, on 2 CPU gloo ranks.

    python tests/real/make.py hf_trainer [-- --case NAME ...]

Each case trains the same tiny `LlamaForCausalLM` (fp32, untied, GQA) for 4 AdamW steps on the
same data with `Trainer(max_steps=4, save_steps=3)` (or accelerate alone), so the folder of
step 3 holds the state the references describe, and the tool's own fourth step is the
next-step reference:

- `hf_trainer_fsdp2_sharded`: FSDP2 (`fsdp_config={"version": 2}`), `SHARDED_STATE_DICT`:
  `checkpoint-3/pytorch_model_fsdp_0/` and `optimizer_0/` (DCP folders), no config.json in it
  (the run's `config.json` is in the output folder above, where the training script saved it).
- `hf_trainer_fsdp2_full`: FSDP2 with `FULL_STATE_DICT`: `checkpoint-3/model.safetensors` +
  `config.json` (save_pretrained of the gathered state dict), `pytorch_model_fsdp.bin` (the same
  state dict, torch.save) and `optimizer.bin` (a torch.save of
  `get_optimizer_state_dict(full_state_dict=True)`, keyed by parameter name).
- `hf_trainer_deepspeed_zero2`: the Trainer with a DeepSpeed ZeRO-2 config: `checkpoint-3/` with
  `config.json`, `model.safetensors`, `latest`, `global_step3/`.
- `deepspeed_universal_zero2`: `ds_to_universal --inject_missing_state` of that `global_step3`
  (DeepSpeed's own converter; the references are the ZeRO-2 case's).
- `accelerate_fsdp2_full_save_state`: a plain accelerate loop (no Trainer) with FSDP2 and
  `FULL_STATE_DICT`, `accelerator.save_state()` after step 3: `pytorch_model_fsdp.bin`,
  `optimizer.bin`, `scheduler.bin`, `random_states_N.pkl` (no trainer_state.json, no config).

Not run: FSDP1 (`fsdp_config={"version": 1}`): accelerate 1.15's
`FullyShardedDataParallelPlugin(fsdp_version=1).__post_init__` raises "There are currently no
available devices found, must be one of 'XPU', 'CUDA', 'MLU', 'NPU', 'MUSA', or 'HPU'" on a
CPU-only machine (it needs a device for `device_id`). Its SHARDED_STATE_DICT layout is the same
DCP pair (`FSDP.optim_state_dict` keys the optimizer by fqn). An accelerate `save_state` with
SHARDED_STATE_DICT writes the Trainer's `pytorch_model_fsdp_0/` + `optimizer_0/` pair (checked
once, not committed: the corpus budget).

References (`reference.safetensors`), all taken from the tool's runtime between the steps (every
parameter gathered whole: FSDP2 `DTensor.full_tensor()`, DeepSpeed `safe_get_full_*`):
`param/<name>` and `exp_avg/<name>`, `exp_avg_sq/<name>` after step 3, `grad/<name>` the gradient
the fourth optimizer step consumed, `param_next/<name>` after it, `logits` of transformers'
forward with the step-3 params on `tokens`. The manifest records the optimizer's hyper-parameters
as torch holds them (`param_groups` without `params`, and the names in each group).

Shims (in the manifest): accelerate turns an FSDP plugin on a CPU-only machine into plain
multi-CPU DDP (`AcceleratorState`: FSDP is chosen only for GPU-like distributed types); the
generator sets the distributed type back to FSDP after accelerate's own setup, with the plugin
accelerate built. DeepSpeed runs with `DS_ACCELERATOR=cpu`; its shared-memory allreduce op build is
skipped (gloo does the collective).
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
WORLD = 2
STEPS = 3  # the saved step; the run takes one more
LLAMA = dict(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, rms_norm_eps=1e-5,
             initializer_range=0.1)
SEQ = 8
HYPER = dict(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8)
CASES = (
    "hf_trainer_fsdp2_sharded",
    "hf_trainer_fsdp2_full",
    "hf_trainer_deepspeed_zero2",
    "deepspeed_universal_zero2",
    "accelerate_fsdp2_full_save_state",
)
DISTS = ["torch", "transformers", "accelerate", "deepspeed", "safetensors", "numpy"]
SHIM_NOTE = (
    "accelerate 1.15 makes an FSDP plugin on a machine without GPUs plain multi-CPU DDP (accelerate/state.py "
    "AcceleratorState: DistributedType.FSDP is chosen only for MULTI_GPU-like types); the generator wraps "
    "AcceleratorState.__init__ and, once an fsdp_plugin was given, sets distributed_type back to FSDP (with "
    "accelerate's own plugin) after every AcceleratorState() (each copies PartialState's MULTI_CPU in again) (tests/real/generators/hf_trainer.py `_fsdp_on_cpu`)"
)


# -- inside each rank ---------------------------------------------------------------------------


def _fsdp_on_cpu() -> None:
    """The shim of SHIM_NOTE."""
    from accelerate import state as acc_state
    from accelerate.utils import DistributedType

    orig = acc_state.AcceleratorState.__init__
    given = {}

    def init(self, *a, fsdp_plugin=None, **kw):
        orig(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None:
            given["plugin"] = fsdp_plugin
        # every AcceleratorState() copies PartialState's MULTI_CPU back in: set FSDP after each
        if given and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = given["plugin"]

    acc_state.AcceleratorState.__init__ = init


def _data():
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, LLAMA["vocab_size"], (4 * WORLD * 2 * 2, SEQ), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def _full(t):
    """A whole fp32 CPU copy of a tensor or DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


class _Refs:
    """What the runtime holds, gathered whole on every rank (rank 0 writes it)."""

    def __init__(self):
        self.arrays: dict = {}
        self.hyper: list = []
        self.step: list = []


def _capture_torch(refs: _Refs, kind: str, model, optimizer) -> None:
    names = {p: n for n, p in model.named_parameters()}
    if kind == "param":
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            refs.hyper.append({**{k: v for k, v in group.items() if k != "params"},
                               "names": [names[p] for p in group["params"]]})
        for p, n in names.items():
            st = inner.state[p]
            refs.arrays[f"exp_avg/{n}"] = _full(st["exp_avg"])
            refs.arrays[f"exp_avg_sq/{n}"] = _full(st["exp_avg_sq"])
            refs.step.append(float(st["step"]))
    for p, n in names.items():
        src = p.grad if kind == "grad" else p
        refs.arrays[f"{kind}/{n}"] = _full(src)


def _trainer_run(case: str, work: str) -> _Refs:
    import torch
    import transformers

    refs = _Refs()
    deepspeed_cfg = None
    fsdp = {}
    if case.startswith("hf_trainer_fsdp"):
        _fsdp_on_cpu()
        version = 1 if "fsdp1" in case else 2
        fsdp = dict(fsdp=True, fsdp_config={
            "version": version,
            "state_dict_type": "FULL_STATE_DICT" if case.endswith("_full") else "SHARDED_STATE_DICT",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        })
    if case == "hf_trainer_deepspeed_zero2":
        deepspeed_cfg = {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "steps_per_print": 10**9,
        }
    args = transformers.TrainingArguments(
        output_dir=work, max_steps=STEPS + 1, save_steps=STEPS, save_strategy="steps",
        per_device_train_batch_size=2, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        logging_steps=1, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        optim="adamw_torch", use_cpu=deepspeed_cfg is None, deepspeed=deepspeed_cfg, **HYPER, **fsdp,
    )
    model = _model()
    if args.process_index == 0:
        model.config.save_pretrained(work)  # what a training script keeps in its output folder

    class Capture(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step in (STEPS, STEPS + 1):
                _capture(refs, "param" if state.global_step == STEPS else "param_next", model, optimizer)

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == STEPS and deepspeed_cfg is None:
                _capture(refs, "grad", model, optimizer)

    def _capture(refs, kind, model, optimizer):
        if deepspeed_cfg is not None:
            _capture_ds(refs, kind, model, optimizer)
        else:
            _capture_torch(refs, kind, model, optimizer)

    if deepspeed_cfg is not None:
        _grad_before_ds_step(refs)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=[Capture()])
    trainer.train()
    torch.distributed.barrier()
    return refs


def _grad_before_ds_step(refs: _Refs) -> None:
    """accelerate's DeepSpeed wrapper runs `engine.backward` and `engine.step` in one call, so the
    gradient of the fourth step is taken inside `DeepSpeedEngine.step`, before the real step."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    orig = DeepSpeedEngine.step
    calls = {"n": 0}

    def step(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == STEPS + 1:
            for n, p in self.module.named_parameters():
                refs.arrays[f"grad/{n}"] = safe_get_full_grad(p).detach().float().cpu().clone()
        return orig(self, *a, **kw)

    DeepSpeedEngine.step = step


def _capture_ds(refs: _Refs, kind: str, model, optimizer) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper -> the ZeRO optimizer
    if getattr(engine_opt, "_hp_optimizer_states_linked", None):  # relink every group (ds_writer.py)
        engine_opt._hp_optimizer_states_linked = False
        engine_opt._lazy_init_hp_params_optimizer_state()
    named = list(model.named_parameters())
    key = "param" if kind == "param" else "param_next"
    for n, p in named:
        refs.arrays[f"{key}/{n}"] = safe_get_full_fp32_param(p).detach().float().cpu().clone()
    if kind == "param":
        base = getattr(engine_opt, "optimizer", engine_opt)
        pnames = {id(p): n for n, p in named}
        for group in base.param_groups:
            refs.hyper.append({k: v for k, v in group.items() if k != "params"})
        for g, group in enumerate(engine_opt.bit16_groups):
            refs.hyper[g]["names"] = [pnames[id(p)] for p in group]
        refs.step = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
        for n, p in named:
            refs.arrays[f"exp_avg/{n}"] = safe_get_full_optimizer_state(p, "exp_avg").detach().float().cpu().clone()
            refs.arrays[f"exp_avg_sq/{n}"] = safe_get_full_optimizer_state(p, "exp_avg_sq").detach().float().cpu().clone()


def _accelerate_run(case: str, work: str) -> _Refs:
    """A plain accelerate loop: FSDP2, SHARDED_STATE_DICT, save_state after step 3."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _fsdp_on_cpu()
    refs = _Refs()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, state_dict_type="FULL_STATE_DICT" if "_full" in case else "SHARDED_STATE_DICT", auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = _model()
    if acc.process_index == 0:
        model.config.save_pretrained(work)
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    h = HYPER
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": h["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=h["learning_rate"], betas=(h["adam_beta1"], h["adam_beta2"]), eps=h["adam_epsilon"],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    data = _data()
    model, opt, sched = acc.prepare(model, opt, sched)
    rank = acc.process_index
    for step in range(STEPS + 1):
        rows = data[(step * WORLD + rank) * 2:(step * WORLD + rank) * 2 + 2]
        ids = torch.stack([r["input_ids"] for r in rows])
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        if step == STEPS:
            _capture_torch(refs, "grad", model, opt)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step == STEPS - 1:
            _capture_torch(refs, "param", model, opt)
            acc.save_state(os.path.join(work, f"checkpoint-{STEPS}"))
    _capture_torch(refs, "param_next", model, opt)
    return refs


def worker(case: str, work: str) -> None:
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if case == "hf_trainer_deepspeed_zero2":
        import deepspeed.comm.torch  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    torch.use_deterministic_algorithms(True)
    run = _accelerate_run if case.startswith("accelerate_") else _trainer_run
    refs = run(case, work)
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in refs.arrays.items()}, os.path.join(work, "refs.safetensors"))
        with open(os.path.join(work, "refs.json"), "w") as f:
            json.dump({"hyper": refs.hyper, "step": sorted(set(refs.step))}, f, default=str)


# -- the driver ---------------------------------------------------------------------------------


def _torchrun(case: str, work: str, env: dict) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(29600 + CASES.index(case)), os.path.abspath(__file__), "--worker", case, "--work", work]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def _logits(params: dict):
    """transformers' forward with the step-3 params on fixed tokens (fp32, eager attention)."""
    import torch

    model = _model()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    model.eval()
    tokens = torch.tensor([[1, 5, 9, 2, 30, 17, 7, 11], [3, 3, 8, 20, 12, 0, 31, 21]])
    with torch.no_grad():
        return tokens, model(input_ids=tokens).logits.float()


def _write_case(out: str, case: str, src: str, work: str, refs_from: str, notes: list[str], **extra) -> None:
    import tools
    import torch
    from safetensors.torch import load_file

    case_dir = tools.fresh_case(out, case)
    shutil.copytree(src, os.path.join(case_dir, "ckpt"), symlinks=False)
    arrays = load_file(os.path.join(refs_from, "refs.safetensors"))
    with open(os.path.join(refs_from, "refs.json")) as f:
        info = json.load(f)
    params = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    tokens, logits = _logits(params)
    arrays |= {"tokens": tokens, "logits": logits}
    tools.write_reference(case_dir, {k: v.numpy() for k, v in arrays.items()})
    tools.record_manifest(
        case_dir, tool="transformers Trainer / accelerate / DeepSpeed on CPU gloo ranks", dists=DISTS,
        command=f"python tests/real/make.py hf_trainer -- --case {case}",
        references={
            "param/<name>": "every parameter after step 3 as the runtime holds it, whole (HF names)",
            "exp_avg/<name>, exp_avg_sq/<name>": "the AdamW moments after step 3, whole",
            "grad/<name>": "the gradient the fourth optimizer step consumed, whole",
            "param_next/<name>": "every parameter after the fourth step (torch.optim.AdamW, hyper in the manifest)",
            "tokens": "[2, 8] fixed tokens",
            "logits": "[2, 8, 32] LlamaForCausalLM (transformers, eager, fp32) with param/<name>",
        },
        notes=notes, hyper=info["hyper"], optimizer_step=info["step"], llama=LLAMA, world=WORLD,
        **extra,
    )
    del torch


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
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    wanted = a.case or list(CASES)
    root = tempfile.mkdtemp(prefix="hf_trainer_")
    ckpt = f"checkpoint-{STEPS}"
    for case in wanted:
        work = os.path.join(root, case)
        notes = []
        if case == "deepspeed_universal_zero2":
            base = os.path.join(root, "hf_trainer_deepspeed_zero2")
            if not os.path.isdir(base):
                _torchrun("hf_trainer_deepspeed_zero2", base, env)
            uni = os.path.join(work, "universal")
            os.makedirs(work, exist_ok=True)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(base, ckpt, f"global_step{STEPS}"), "--output_folder",
                   os.path.join(uni, f"global_step{STEPS}_universal"), "--inject_missing_state"]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, env=env, check=True)
            _write_case(a.out, case, uni, work, base, notes + [
                "ds_to_universal of the hf_trainer_deepspeed_zero2 run's global_step3 (ZeRO-2, 2 ranks): "
                "`python -m deepspeed.checkpoint.ds_to_universal --input_folder .../global_step3 "
                "--output_folder .../global_step3_universal --inject_missing_state`"],
                reference_case="hf_trainer_deepspeed_zero2")
            continue
        _torchrun(case, work, env)
        if case.startswith("hf_trainer_fsdp") or case.startswith("accelerate_"):
            notes.append(SHIM_NOTE)
        if case == "hf_trainer_deepspeed_zero2":
            notes.append("DeepSpeed with DS_ACCELERATOR=cpu; deepspeed.comm.torch.build_shm_op (a shared-memory "
                         "allreduce JIT-compiled for the CPU accelerator) skipped: gloo does the collective")
        keep = tempfile.mkdtemp(prefix="keep_", dir=root)
        shutil.copy(os.path.join(work, "config.json"), keep)
        shutil.copytree(os.path.join(work, ckpt), os.path.join(keep, ckpt))
        notes.append("the output folder as the run left it, less checkpoint-4 (the step after, which the "
                     "references describe) and the final model save; config.json was saved there by the "
                     "training script (model.config.save_pretrained(output_dir))")
        _write_case(a.out, case, keep, work, work, notes)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
