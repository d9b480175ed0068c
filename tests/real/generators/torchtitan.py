"""torchtitan 0.3.0 writes its own checkpoints: Llama 3, Qwen3 (tied head) and Qwen3-MoE with
expert parallelism, trained on gloo CPU ranks and saved by its CheckpointManager.

    python tests/real/make.py torchtitan            # the committed cases
    python tests/real/make.py torchtitan -- --case qwen3_moe
    python tests/real/make.py torchtitan -- --case deepseek_v3   # on request only (below)

`deepseek_v3` (MLA with q LoRA, yarn, a dense then an MoE layer with a shared expert, sigmoid
group-limited routing, one MTP layer; EP 2 x FSDP 2) runs too but is not committed: 3.7 MB, past
the corpus budget (torchtitan pickles every param-group value separately, ~2 KB each, so the
files grow with the parameter count, not the sizes).

Each case runs torchtitan's own model code (`models/<family>` configs, `parallelize_fn`: FSDP2,
and for the MoE case expert parallel over 2 x FSDP over 2 on 4 ranks), its OptimizersContainer
(AdamW, fused CPU kernel), LRSchedulersContainer (warmup 2), ParallelAwareDataloader and
`Trainer.train_step` for 3 steps, `CheckpointManager.save` writing `ckpt/step-3/` (its
interval; full states: model, optimizer, lr_scheduler, dataloader, train_state). Then, from
the same runtime, the references (`torchtitan_parts/titan_rank.py`) and one more step. The CPU shims are in
`torchtitan_parts/titan_shims.py` and in each manifest's notes. Beside the checkpoint, `config.json` is the HF
config describing the same model (torchtitan saves none; it is what a user passes to `--config`).
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
# this file is `torchtitan.py`: with its folder on sys.path, `import torchtitan` would find it
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
sys.path.insert(0, os.path.join(HERE, "torchtitan_parts"))

import titan_models  # noqa: E402
import titan_rank  # noqa: E402
import titan_shims  # noqa: E402
import tools  # noqa: E402  (tests/real/tools.py, on PYTHONPATH from make.py)

DEFAULT = ("llama3", "qwen3", "qwen3_moe")  # committed; see the module doc for deepseek_v3
DISTS = ["torchtitan", "torch", "triton", "torchdata", "spmd_types", "safetensors", "numpy"]
REFERENCES = {
    "param/<hf>": "params at the saved step: the model state dict (q/k/v split by torchtitan's own "
    "FusedQKVLinear hook) through the model's StateDictAdapter.to_hf (HF names, Llama q/k rows "
    "permuted by it)",
    "exp_avg/<hf>, exp_avg_sq/<hf>": "AdamW moments keyed by parameter (fused wqkv), split by "
    "FusedQKVLinear._split_qkv_on_save and taken through to_hf like the params",
    "step": "AdamW's step count at the save",
    "tokens, logits": "torchtitan's forward (eval, fp32 FSDP compute) of the saved model on fixed tokens [1, 16]",
    "tokens_without_expert_bias, logits_without_expert_bias": "MoE only: the same forward with the "
    "load-balancing expert_bias_E zeroed (HF Qwen3-MoE has no such bias; torchtitan's to_hf drops it)",
    "grad/<hf>": "the next step's gradients as AdamW sees them (after the trainer's clip_grad_norm_), "
    "split and to_hf like the moments",
    "next/<hf>": "params after torchtitan's own next optimizer step (to_hf)",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_case(out: str, name: str, command: str) -> None:
    titan_shims.install()
    case = titan_models.CASES[name]()  # for its world size and HF config
    d = tools.fresh_case(out, case.name)
    result = os.path.join(d, "_ref.npz")
    mp.spawn(
        titan_rank.run, args=(case.world, _port(), name, d, result), nprocs=case.world, join=True
    )
    with np.load(result) as z:
        ref = {k: z[k] for k in z.files}
    os.remove(result)
    tools.write_reference(d, ref)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(case.hf_config, f, indent=1, sort_keys=True)
        f.write("\n")
    tools.record_manifest(
        d, tool="torchtitan", dists=DISTS, command=command, references=REFERENCES,
        notes=titan_shims.NOTES, world_size=case.world,
        parallelism={"data_parallel_shard_degree": -1, **case.parallelism},
        train={"steps_saved": [titan_rank.STEPS], "seq_len": titan_rank.SEQ,
               "local_batch_size": 1, "lr": titan_rank.LR, "warmup_steps": 2,
               "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "max_norm": 1.0},
        config_json="config.json: the HF config of the same model (written by the generator)",
    )  # fmt: skip
    print(f"wrote {d}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", choices=sorted(titan_models.CASES))
    a = ap.parse_args()
    for name in a.case or DEFAULT:
        write_case(
            a.out,
            name,
            "python tests/real/make.py torchtitan" + (f" -- --case {name}" if a.case else ""),
        )


if __name__ == "__main__":
    main()
