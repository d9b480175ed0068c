"""Megatron-LM / megatron-core 0.19.2 checkpoints written by Megatron itself on gloo CPU ranks.

    python tests/real/make.py megatron_core

Each training run is Megatron-LM's own code (`megatron/training` as shipped in the megatron-core
0.19.2 wheel, identical to NVIDIA/Megatron-LM tag core_v0.19.0, commit
5be9626709af2722333bf54797c954c09edeada3): `initialize_megatron`, `setup_model_and_optimizer`
(GPTModel, DDP, DistributedOptimizer), `train_step` x 3 on synthetic tokens, then
`save_checkpoint` of that one state in several formats (`_megatron_core_run.py train`). The
references come from Megatron's runtime too: one rank (tp = pp = ep = dp = 1) loads the
`fully_reshardable` save with Megatron-LM's `load_checkpoint` (megatron-core's resharding), and
records every parameter, its Adam moments, the step, GPTModel's logits on fixed tokens, and one
more `train_step`: the gradients its optimizer step consumed and the params after it
(`_megatron_core_run.py reference`). CPU shims: `_megatron_core_shims.py` (listed in each
manifest's notes).

Cases (tests/real/cases/<case>/):
- `megatron_core_dense_dp_reshardable`: Llama-like GPTModel (SwiGLU, RMSNorm, RoPE, GQA, untied
  head, local spec), torch_dist on tp2 x pp2 x dp2, distributed optimizer `dp_reshardable`
  (the default); holds the references of the dense state.
- `megatron_core_dense_fully_reshardable`: the same state, `--dist-ckpt-optim-fully-reshardable`.
- `megatron_lm_dense_torch`: the same state, the legacy `--ckpt-format torch` (per-rank
  `model_optim_rng.pt` + `distrib_optim.pt`).
- `megatron_core_moe_sequential_dp_reshardable`: Mixtral-like MoE (4 experts, top-2,
  SequentialMLP, local spec) on tp2 x pp2 x ep2 (dp2), torch_dist `dp_reshardable`, with its
  references.
Not made, and why (recorded in the manifests): TEGroupedMLP / the TE spec / `--moe-grouped-gemm`
need transformer_engine (CUDA-only build: `pip install transformer-engine[pytorch]` compiles
against CUDA and nvcc, neither here); the legacy GroupedMLP is gone from megatron-core 0.19.
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
MEGATRON_CORE = "megatron-core==0.19.2"
MEGATRON_LM_COMMIT = "5be9626709af2722333bf54797c954c09edeada3"  # tag core_v0.19.0

COMMON = """
--num-layers 2 --hidden-size 16 --num-attention-heads 4 --group-query-attention --num-query-groups 2
--ffn-hidden-size 24 --seq-length 8 --max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 4
--swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope
--untie-embeddings-and-output-weights --disable-bias-linear --transformer-impl local
--tokenizer-type NullTokenizer --vocab-size 60 --make-vocab-size-divisible-by 8
--use-distributed-optimizer --lr 0.01 --min-lr 0.01 --lr-decay-style constant --train-iters 3
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 0.0
--init-method-std 0.1 --seed 1234 --attention-dropout 0 --hidden-dropout 0
--distributed-backend gloo --use-cpu-initialization --no-gradient-accumulation-fusion
--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
--no-persist-layer-norm --ckpt-format torch_dist --save-interval 1000 --log-interval 1000
""".split()
MOE = """
--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-token-dispatcher-type allgather
--moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2 --sequence-parallel
""".split()
PARALLEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
SINGLE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]

NOT_MADE = [
    "TEGroupedMLP, the Transformer Engine spec and --moe-grouped-gemm were not run: they need "
    "transformer_engine, whose PyTorch extension builds only against CUDA (nvcc, CUDA headers), "
    "absent on this CPU machine; megatron-core 0.19 has no legacy GroupedMLP any more "
    "(--moe-use-legacy-grouped-gemm). Their torch_dist keys are by megatron's own code the "
    "SequentialMLP ones (TEGroupedMLP.sharded_state_dict: 'to match sequential's keys').",
]


def ensure_megatron() -> None:
    """megatron-core 0.19.2 ships a cp312 wheel only (Requires-Python >= 3.12) but runs on 3.11,
    where torch 2.13.0 CPU installs from a local file: put it into this venv with pip --target."""
    import importlib.util
    import sysconfig

    if importlib.util.find_spec("megatron.core") is not None:
        return

    site = sysconfig.get_paths()["purelib"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python",
         "--python-version", "3.12", "--only-binary=:all:", "--target", site, MEGATRON_CORE],
        check=True,
    )  # fmt: skip


def torchrun(n: int, mode: str, out: str, args: list[str], log: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           "--master-port=29517", os.path.join(HERE, "_megatron_core_run.py"), mode, out, "--", *args]  # fmt: skip
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        with open(log) as f:
            tail = f.read()[-6000:]
        raise SystemExit(f"megatron_core: {mode} failed ({r.returncode}); log {log}:\n{tail}")


def references(ref_pt: str) -> tuple[dict, dict]:
    """(arrays for reference.safetensors, facts for the manifest) of a reference run."""
    import torch

    r = torch.load(ref_pt, weights_only=False)
    arrays = {"tokens": r["tokens"].numpy(), "logits": r["logits"].float().numpy()}
    for kind, prefix in (("params", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"),
                         ("grads", "grad"), ("params_after", "param_next")):  # fmt: skip
        for name, t in r[kind].items():
            arrays[f"{prefix}/{name}"] = t.detach().float().numpy()
    # fp32 training: the optimizer's main params are the model params (checked, not stored)
    for name, t in r["master"].items():
        if not torch.equal(t, r["params"][name]):
            raise SystemExit(f"megatron_core: the fp32 main param of {name} differs from the param")
    facts = {
        "optimizer_step": r["steps"],
        "iteration": r["iteration"],
        "optimizer_class": r["optimizer_class"],
        "hyper": r["hyper"],
        "no_weight_decay": sorted(r["no_weight_decay"]),
        "master_equals_param": True,
    }
    return arrays, facts


def model_space_moments(save: str) -> dict:
    """`exp_avg/<name>`, `exp_avg_sq/<name>` read with torch DCP from Megatron's own
    fully_reshardable save (`optimizer.state.<kind>.<model key>`: global tensors, the layer axis
    of stacked keys first, then the expert axis of `mlp.experts.experts.*`), under the names of a
    tp = pp = ep = 1 model: per layer, experts as `mlp.experts.local_experts.{e}`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = os.path.join(save, "iter_0000003")
    md = dcp.FileSystemReader(folder).read_metadata()
    want = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and k.startswith("optimizer.state.exp_avg")}  # fmt: skip
    dcp.load(want, checkpoint_id=folder, no_dist=True)
    out = {}
    for key, t in want.items():
        kind, name = key[len("optimizer.state."):].split(".", 1)
        if not name.startswith("decoder.layers.") or name.split(".")[2].isdigit():
            out[f"{kind}/{name}"] = t.numpy()
            continue
        rest = name[len("decoder.layers."):]
        for layer in range(t.shape[0]):
            if rest.startswith("mlp.experts.experts."):
                for e in range(t.shape[1]):
                    local = rest.replace("mlp.experts.experts.", f"mlp.experts.local_experts.{e}.")
                    out[f"{kind}/decoder.layers.{layer}.{local}"] = t[layer, e].numpy()
            else:  # the TE norm names of the local spec's norms (gpt_layer_specs.py keys map)
                local = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}.get(rest, rest)  # fmt: skip
                out[f"{kind}/decoder.layers.{layer}.{local}"] = t[layer].numpy()
    return out


REFERENCE_DOC = {
    "param/<name>": "every parameter after the saved step, megatron-core names (tp=pp=1 model "
    "loaded from the fully_reshardable save; linear_fc1 [gate; up] rows, linear_qkv per query "
    "group [q heads; k; v] rows, the padded vocabulary)",
    "exp_avg/<name>, exp_avg_sq/<name>": "Adam moments of each parameter (DistributedOptimizer "
    "_get_main_param_and_optimizer_states)",
    "tokens": "[2, 8] int64 fixed tokens",
    "logits": "[2, 8, padded_vocab] GPTModel(tokens, position_ids, causal mask) in eval mode, fp32",
    "grad/<name>": "the gradient the next train_step's optimizer step consumed (the main param's "
    ".grad inside torch.optim.AdamW.step)",
    "param_next/<name>": "parameters after that step (torch.optim.AdamW inside Megatron's "
    "DistributedOptimizer; lr/betas/eps/weight_decay in the manifest's hyper, no weight decay "
    "for the names in no_weight_decay)",
}


def make(out: str, name: str, moe: bool, keep: str | None) -> None:
    import _megatron_core_shims as shims
    from tools import fresh_case, record_manifest, write_reference

    work = keep or tempfile.mkdtemp(prefix=f"megatron_core_{name}_")
    os.makedirs(work, exist_ok=True)
    extra = MOE if moe else []
    saves = {"dp": os.path.join(work, "dp_reshardable"), "fully": os.path.join(work, "fully_reshardable"),
             "torch": os.path.join(work, "torch")}  # fmt: skip
    for d in saves.values():
        shutil.rmtree(d, ignore_errors=True)
    plan = [[saves["dp"], "torch_dist", False], [saves["fully"], "torch_dist", True]]
    if not moe:
        plan.append([saves["torch"], "torch", False])
    train_args = [*COMMON, *extra, *PARALLEL, "--save", saves["dp"]]
    torchrun(8, "train", json.dumps(plan), train_args, os.path.join(work, "train.log"))
    ref_pt = os.path.join(work, "reference.pt")
    # one rank holds every expert (ep 1), where Megatron chains no experts' optimizer: the ep 2
    # save's chained [dense, experts] optimizer does not load there (KeyError 'optimizer' in
    # DistributedOptimizer.load_state_dict), so the MoE reference run loads the weights only
    single = ["--expert-model-parallel-size", "1", "--no-load-optim"] if moe else []
    ref_args = [*COMMON, *[a for a in extra if a != "--sequence-parallel"], *SINGLE, *single,
                "--load", saves["fully"], "--exit-on-missing-checkpoint"]  # fmt: skip
    torchrun(1, "reference", ref_pt, ref_args, os.path.join(work, "reference.log"))
    arrays, facts = references(ref_pt)
    if moe:
        arrays.update(model_space_moments(saves["fully"]))
        facts.update(optimizer_step=[3], no_weight_decay=[])
    dists = ["megatron-core", "torch", "numpy"]
    cmd = "python tests/real/make.py megatron_core"
    notes = [*shims.NOTES, f"Megatron-LM training code: megatron/training from the megatron-core "
             f"0.19.2 wheel (= NVIDIA/Megatron-LM core_v0.19.0, {MEGATRON_LM_COMMIT})", *NOT_MADE]  # fmt: skip
    train = "torchrun --nproc-per-node 8 _megatron_core_run.py train (Megatron-LM " + " ".join(train_args) + ")"
    if moe:
        cases = [("megatron_core_moe_sequential_dp_reshardable", saves["dp"], "dp_reshardable")]
    else:
        cases = [("megatron_core_dense_dp_reshardable", saves["dp"], "dp_reshardable"),
                 ("megatron_core_dense_fully_reshardable", saves["fully"], "fully_reshardable"),
                 ("megatron_lm_dense_torch", saves["torch"], "legacy torch format, distrib_optim.pt")]  # fmt: skip
    ref_case = cases[0][0]
    for case, src, what in cases:
        d = fresh_case(out, case)
        shutil.copytree(src, os.path.join(d, "ckpt"))
        if case == ref_case:
            write_reference(d, arrays)
        record_manifest(
            d, tool="Megatron-LM + megatron-core (GPTModel, DistributedOptimizer, save_checkpoint)",
            dists=dists, command=cmd, references=REFERENCE_DOC if case == ref_case else {},
            notes=notes, reference_case=ref_case, optimizer_format=what, training=train,
            parallel={"tp": 2, "pp": 2, "dp": 2, "ep": 2 if moe else 1}, vocab_size=60,
            padded_vocab_size=64, **facts,
        )  # fmt: skip
        print(f"wrote {d}", flush=True)
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=["dense", "moe"])
    ap.add_argument("--keep", help="a work folder to keep the runs' logs and saves in")
    a = ap.parse_args()
    ensure_megatron()
    for name, moe in (("dense", False), ("moe", True)):
        if a.only in (None, name):
            make(a.out, name, moe, a.keep and os.path.join(a.keep, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
