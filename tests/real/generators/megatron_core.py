"""Megatron-LM / megatron-core 0.19.2 checkpoints written by Megatron itself on gloo CPU ranks.

    python tests/real/make.py megatron_core

Each training run is Megatron-LM's own code (`megatron/training` as shipped in the megatron-core
0.19.2 wheel, identical to NVIDIA/Megatron-LM tag core_v0.19.0, commit
5be9626709af2722333bf54797c954c09edeada3): `initialize_megatron`, `setup_model_and_optimizer`
(GPTModel, DDP, DistributedOptimizer), `train_step` x 3 on synthetic tokens, then
`save_checkpoint` of that one state in several formats (`_megatron_core_run.py train`). The
references come from Megatron's runtime too: ranks with tp = pp = 1 load the `fully_reshardable`
save with Megatron-LM's `load_checkpoint` (megatron-core's resharding) and record every
parameter, its Adam moments and fp32 master (the slices each data-parallel rank's distributed
optimizer owns, joined here: `join_ranks`), the step, GPTModel's logits on fixed tokens, and
one more `train_step`: the gradients its optimizer step consumed and the params after it
(`_megatron_core_run.py reference`). One rank for a dense or ep 1 save; for the ep 2 save two
(tp = pp = 1, ep = 2): its chained [dense, experts] optimizer loads only into a model with the
same chain (one rank at ep 1 builds one unchained optimizer: KeyError 'optimizer' in
DistributedOptimizer.load_state_dict). CPU shims: `_megatron_core_shims.py` (listed in each
manifest's notes).

Cases (tests/real/cases/<case>/):
- `megatron_core_dense_dp_reshardable`: Llama-like GPTModel (SwiGLU, RMSNorm, RoPE, GQA, untied
  head, local spec), torch_dist on tp2 x pp2 x dp2, distributed optimizer `dp_reshardable`
  (the default); holds the references of the dense state.
- `megatron_core_dense_fully_reshardable`: the same state, `--dist-ckpt-optim-fully-reshardable`.
- `megatron_lm_dense_torch`: the same state, the legacy `--ckpt-format torch` (per-rank
  `model_optim_rng.pt` + `distrib_optim.pt`).
- `megatron_core_moe_sequential_dp_reshardable`: Mixtral-like MoE (4 experts, top-2,
  SequentialMLP, local spec) on tp2 x pp2 x ep2 (dp2), torch_dist `dp_reshardable`, optimizer
  chained [dense, experts], with its references.
- `megatron_core_moe_ep1_dp_reshardable`: MoE (2 experts, top-2, SequentialMLP) on tp1 x pp2 x
  dp2 with ep1: one unchained optimizer, the experts in the dense buffers, with its references.
- `megatron_core_glm45_torch_dist`, `megatron_lm_glm45_torch`: a GLM-4.5-like MoE (4 layers,
  2 dense then 2 MoE of 4 experts top-2, sigmoid router with its trained expert bias, scaling
  2.5, one shared expert, q/k/v biases, q/k norms, `--rotary-percent 0.5`, one MTP layer) on tp2 x pp2, model
  only (`--no-save-optim`), as torch_dist and the legacy torch format; its reference run
  (`_megatron_core_run.py forward`, tp = pp = 1) records the params, the routers' expert_bias and
  the logits. Its training installs `finalize_model_grads` as Megatron-LM's `train()` does (the
  expert-bias update lives there; the older runs above call `train_step` without it).
- `megatron_core_llama4_torch_dist`: a Llama-4-like MoE (4 layers, MoE every other one, top-1
  sigmoid router scaling the expert input, one shared expert, NoPE every 2nd layer, complex-pair
  RoPE) on tp2 x pp2, model only, torch_dist; `forward` reference as above.
The MoE runs save without RNG state (`--no-save-rng`; the dense saves keep it) to stay within the
corpus budget: every parameter slice is a DCP chunk of its own, each a torch.save archive.
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
from dataclasses import dataclass

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
--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 8 --moe-token-dispatcher-type allgather
--moe-aux-loss-coeff 0.01 --no-save-rng --no-load-rng
""".split()
MOE_EP1 = [*MOE, "--expert-model-parallel-size", "1"]
MOE_EP1[MOE_EP1.index("--num-experts") + 1] = "2"
# GLM-4.5-like (Megatron-Bridge glm45_bridge / the GLM-4.5 launch args): 4 layers, the first two
# dense (`--moe-layer-freq [0,0,1,1]`: two of each, so a pp 2 mesh splits both groups), a sigmoid
# router with the expert bias (updated by Megatron's own rule in finalize_model_grads), the top-k
# scaling factor, one shared expert (no router groups: with 4 experts, groups of 2 and top-2 a
# group's choice would fix both experts), q/k/v biases (`--add-qkv-bias`), per-head q/k RMSNorm,
# half the head dims rotated (`--rotary-percent 0.5`, kv_channels 8: 4 rotated dims), one MTP
# layer (Bridge's GLM-4.5 trains one; scaling 0.3 as its provider);
# SequentialMLP on ep 1. The model only (`--no-save-optim`): the optimizer paths are the cases above.
GLM = """
--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 8 --moe-token-dispatcher-type allgather
--num-layers 4 --moe-layer-freq [0,0,1,1] --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 0.05
--moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 8
--moe-aux-loss-coeff 0 --expert-model-parallel-size 1
--add-qkv-bias --qk-layernorm --rotary-percent 0.5 --kv-channels 8 --rotary-base 1000000
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
--no-save-optim --no-save-rng --no-load-optim --no-load-rng
""".split()
# Llama-4-like (Megatron-Bridge's Llama 4 provider facts): 4 layers, MoE every other one
# (`--moe-layer-freq [0,1,0,1]`, HF interleave step 2), top-1 sigmoid router scaling the expert
# input, one shared expert of the experts' width, NoPE every 2nd layer (`--no-rope-freq 2`),
# complex-pair RoPE (`--rotary-interleaved`); no `--qk-l2-norm` (the stock spec would normalize
# the NoPE layers too, which HF Llama 4 does not; see models/llama4/dialects/megatron.py)
LLAMA4 = """
--num-layers 4 --num-experts 4 --moe-router-topk 1 --moe-ffn-hidden-size 8
--moe-token-dispatcher-type allgather --moe-layer-freq [0,1,0,1] --moe-router-score-function sigmoid
--moe-apply-probs-on-input --moe-shared-expert-intermediate-size 8 --moe-aux-loss-coeff 0
--expert-model-parallel-size 1 --no-rope-freq 2 --rotary-interleaved
--no-save-optim --no-save-rng --no-load-optim --no-load-rng
""".split()
PARALLEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
SINGLE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]

EAGER = (
    "TORCHDYNAMO_DISABLE=1: megatron-core's torch.compile'd helpers (jit_fuser, e.g. the sigmoid "
    "router's score function) run eagerly, the same torch ops (inductor wants CUDA device "
    "properties the CPU shims do not have)"
)
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

    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return  # (find_spec of "megatron.core" alone raises while "megatron" is missing)

    site = sysconfig.get_paths()["purelib"]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--ignore-requires-python",
         "--python-version", "3.12", "--only-binary=:all:", "--target", site, MEGATRON_CORE],
        check=True,
    )  # fmt: skip


def torchrun(n: int, mode: str, out: str, args: list[str], log: str, finalize: bool = False) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           "--master-port=29517", os.path.join(HERE, "_megatron_core_run.py"), mode, out, "--", *args]  # fmt: skip
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
                                  MEGATRON_FINALIZE_GRADS="1" if finalize else "0"))
    if r.returncode:
        with open(log) as f:
            tail = f.read()[-6000:]
        raise SystemExit(f"megatron_core: {mode} failed ({r.returncode}); log {log}:\n{tail}")


def join_ranks(prefix: str, n: int) -> tuple[dict, dict]:
    """(arrays for reference.safetensors, facts for the manifest) of a reference run's `n` rank
    files: full params as the ranks hold them (a param two ranks hold must agree bit for bit),
    and each flattened param's optimizer state joined from the slices the data-parallel ranks'
    distributed optimizers own (every element covered, overlaps equal)."""
    import numpy as np
    import torch

    rs = [torch.load(f"{prefix}.rank{r}", weights_only=False) for r in range(n)]
    arrays = {"tokens": rs[0]["tokens"].numpy(), "logits": rs[0]["logits"].float().numpy()}

    def put(key: str, a) -> None:
        if key in arrays and not np.array_equal(arrays[key].view(np.uint32), a.view(np.uint32)):
            raise SystemExit(f"megatron_core: ranks disagree on {key}")
        arrays[key] = a

    shapes: dict = {}
    for r in rs:
        if not torch.equal(r["logits"], rs[0]["logits"]):
            raise SystemExit("megatron_core: ranks computed different logits for the same tokens")
        shapes.update(r["shapes"])
        for kind, pre in (("params", "param"), ("params_after", "param_next")):
            for name, t in r[kind].items():
                put(f"{pre}/{name}", t.detach().float().numpy())
    flat: dict = {}
    for r in rs:
        for name, sl in r["slices"].items():
            a, b = sl["range"]
            numel = int(np.prod(shapes[name]))
            for slot in ("exp_avg", "exp_avg_sq", "grad", "master"):
                buf, seen = flat.setdefault((slot, name), (np.zeros(numel, np.float32), np.zeros(numel, bool)))
                v = sl[slot].float().numpy()
                if seen[a:b].any() and not np.array_equal(buf[a:b][seen[a:b]], v[seen[a:b]]):
                    raise SystemExit(f"megatron_core: ranks disagree on {slot} of {name}")
                buf[a:b], seen[a:b] = v, True
    for (slot, name), (buf, seen) in flat.items():
        if not seen.all():
            raise SystemExit(f"megatron_core: {slot} of {name}: {int((~seen).sum())} elements on no rank")
        arr = buf.reshape(shapes[name])
        if slot == "master":  # fp32 training: the optimizer's main params are the model params
            if not np.array_equal(arr.view(np.uint32), arrays[f"param/{name}"].view(np.uint32)):
                raise SystemExit(f"megatron_core: the fp32 main param of {name} differs from the param")
            continue
        arrays[f"{slot}/{name}"] = arr
    missing = sorted(set(shapes) - {name for _, name in flat})
    if missing:
        raise SystemExit(f"megatron_core: no optimizer state for {missing[:3]}")
    steps = sorted({s for r in rs for s in r["steps"]})
    facts = {
        "optimizer_step": steps,
        "iteration": rs[0]["iteration"],
        "optimizer_class": rs[0]["optimizer_class"],
        "hyper": rs[0]["hyper"],
        "no_weight_decay": sorted({x for r in rs for x in r["no_weight_decay"]}),
        "master_equals_param": True,  # checked above, every element of every param
        "reference_ranks": n,
    }
    return arrays, facts


REFERENCE_DOC = {
    "param/<name>": "every parameter after the saved step, megatron-core names (tp=pp=1 model "
    "loaded from the fully_reshardable save; linear_fc1 [gate; up] rows, linear_qkv per query "
    "group [q heads; k; v] rows, the padded vocabulary)",
    "exp_avg/<name>, exp_avg_sq/<name>": "Adam moments of each parameter (DistributedOptimizer "
    "_get_main_param_and_optimizer_states, the slices of the reference run's data-parallel ranks "
    "joined); routed experts under their global index, mlp.experts.local_experts.<e>",
    "tokens": "[2, 8] int64 fixed tokens",
    "logits": "[2, 8, padded_vocab] GPTModel(tokens, position_ids, causal mask) in eval mode, fp32",
    "grad/<name>": "the gradient the next train_step's optimizer step consumed (the main param's "
    ".grad inside torch.optim.AdamW.step)",
    "param_next/<name>": "parameters after that step (torch.optim.AdamW inside Megatron's "
    "DistributedOptimizer; lr/betas/eps/weight_decay in the manifest's hyper, no weight decay "
    "for the names in no_weight_decay)",
}


@dataclass(frozen=True)
class Run:
    """One training run of Megatron-LM and the cases cut from its saves.

    `args` its model / parallel arguments beyond COMMON, `ranks` its world size, `parallel` the
    degrees for the manifest; `formats` the saves besides the fully_reshardable one (which the
    reference run loads); `ref_args`, `ref_ranks` the reference run's parallel arguments (tp =
    pp = 1; an expert-parallel save's chained [dense, experts] optimizer loads only into the same
    chain, so with the same ep); `cases` (case, save, what the manifest calls its optimizer
    format), the first holding the references."""

    args: tuple[str, ...]
    ranks: int
    parallel: dict
    formats: tuple[str, ...]
    ref_args: tuple[str, ...]
    ref_ranks: int
    cases: tuple[tuple[str, str, str], ...]
    # a model-only save: the reference is `forward` (params, logits); its training installs
    # `finalize_model_grads` as Megatron-LM's `train()` does (the expert-bias update is there)
    forward_only: bool = False


RUNS = {
    "dense": Run(
        (*PARALLEL,), 8, {"tp": 2, "pp": 2, "dp": 2, "ep": 1}, ("dp", "torch"), (*SINGLE,), 1,
        (("megatron_core_dense_dp_reshardable", "dp", "dp_reshardable"),
         ("megatron_core_dense_fully_reshardable", "fully", "fully_reshardable"),
         ("megatron_lm_dense_torch", "torch", "legacy torch format, distrib_optim.pt")),
    ),  # fmt: skip
    # expert parallel: the optimizer is chained [dense, experts] (chained_0. / chained_1.)
    "moe": Run(
        (*MOE, "--expert-model-parallel-size", "2", "--sequence-parallel", *PARALLEL), 8,
        {"tp": 2, "pp": 2, "dp": 2, "ep": 2}, ("dp",),
        (*MOE, "--expert-model-parallel-size", "2", *SINGLE), 2,
        (("megatron_core_moe_sequential_dp_reshardable", "dp", "dp_reshardable"),),
    ),  # fmt: skip
    # ep 1 (experts split like the dense layers): no chain, the experts in the dense buffers;
    # 2 experts (top 2: the router's weights still weigh them) and tp 1 keep the case small
    # (every parameter slice is a DCP chunk of its own; the experts' tp merge is the ep 2 case's)
    "moe_ep1": Run(
        (*MOE_EP1, "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"), 4,
        {"tp": 1, "pp": 2, "dp": 2, "ep": 1}, ("dp",), (*MOE_EP1, *SINGLE), 1,
        (("megatron_core_moe_ep1_dp_reshardable", "dp", "dp_reshardable"),),
    ),  # fmt: skip
    # GLM-4.5-like MoE on tp2 pp2 (dp 1), model only: torch_dist and the legacy torch format
    "glm45": Run(
        (*GLM, "--sequence-parallel", *PARALLEL), 4, {"tp": 2, "pp": 2, "dp": 1, "ep": 1}, ("torch",), (*GLM, *SINGLE), 1,
        (("megatron_core_glm45_torch_dist", "fully", "none (--no-save-optim)"),
         ("megatron_lm_glm45_torch", "torch", "none (--no-save-optim), legacy torch format")),
        forward_only=True,
    ),  # fmt: skip
    # Llama-4-like MoE on tp2 pp2, model only, torch_dist
    "llama4": Run(
        (*LLAMA4, "--sequence-parallel", *PARALLEL), 4, {"tp": 2, "pp": 2, "dp": 1, "ep": 1}, (),
        (*LLAMA4, *SINGLE), 1,
        (("megatron_core_llama4_torch_dist", "fully", "none (--no-save-optim)"),),
        forward_only=True,
    ),  # fmt: skip
}


def join_forward(prefix: str, n: int) -> tuple[dict, dict]:
    """(arrays, facts) of a `forward` reference run: params, the routers' expert_bias buffers
    (`buffer/<name>`), tokens and logits (one rank: tp = pp = ep = 1)."""
    import torch

    (r,) = [torch.load(f"{prefix}.rank{i}", weights_only=False) for i in range(n)]
    arrays = {"tokens": r["tokens"].numpy(), "logits": r["logits"].float().numpy()}
    for kind, pre in (("params", "param"), ("buffers", "buffer")):
        for name, t in r[kind].items():
            arrays[f"{pre}/{name}"] = t.detach().float().numpy()
    return arrays, {"iteration": r["iteration"], "reference_ranks": n}


FORWARD_DOC = {
    "param/<name>": REFERENCE_DOC["param/<name>"],
    "buffer/<name>": "the MoE routers' expert_bias buffers (fp32), as the reference run loaded them",
    "tokens": REFERENCE_DOC["tokens"],
    "logits": REFERENCE_DOC["logits"],
}


def make(out: str, name: str, run: Run, keep: str | None) -> None:
    import _megatron_core_shims as shims
    from tools import fresh_case, record_manifest, write_reference

    work = keep or tempfile.mkdtemp(prefix=f"megatron_core_{name}_")
    os.makedirs(work, exist_ok=True)
    saves = {f: os.path.join(work, f) for f in ("fully", *run.formats)}
    for d in saves.values():
        shutil.rmtree(d, ignore_errors=True)
    how = {"dp": ("torch_dist", False), "fully": ("torch_dist", True), "torch": ("torch", False)}
    plan = [[saves[f], *how[f]] for f in run.formats + ("fully",)]
    train_args = [*COMMON, *run.args, "--save", saves[(*run.formats, "fully")[0]]]
    torchrun(run.ranks, "train", json.dumps(plan), train_args, os.path.join(work, "train.log"),
             finalize=run.forward_only)
    ref_pt = os.path.join(work, "reference.pt")
    ref_args = [*COMMON, *run.ref_args, "--load", saves["fully"], "--exit-on-missing-checkpoint"]
    mode = "forward" if run.forward_only else "reference"
    torchrun(run.ref_ranks, mode, ref_pt, ref_args, os.path.join(work, "reference.log"))
    arrays, facts = (join_forward if run.forward_only else join_ranks)(ref_pt, run.ref_ranks)
    doc = FORWARD_DOC if run.forward_only else REFERENCE_DOC
    dists = ["megatron-core", "torch", "numpy"]
    cmd = "python tests/real/make.py megatron_core"
    notes = [*shims.NOTES, f"Megatron-LM training code: megatron/training from the megatron-core "
             f"0.19.2 wheel (= NVIDIA/Megatron-LM core_v0.19.0, {MEGATRON_LM_COMMIT})", *NOT_MADE]
    notes.append(EAGER)  # fmt: skip
    train = (f"torchrun --nproc-per-node {run.ranks} _megatron_core_run.py train (Megatron-LM "
             + " ".join(train_args) + ")").replace(work, "<work>")  # fmt: skip
    reference = (f"torchrun --nproc-per-node {run.ref_ranks} _megatron_core_run.py {mode} "
                 f"(Megatron-LM {' '.join(ref_args)})").replace(work, "<work>")  # fmt: skip
    ref_case = run.cases[0][0]
    for case, save, what in run.cases:
        d = fresh_case(out, case)
        shutil.copytree(saves[save], os.path.join(d, "ckpt"))
        if case == ref_case:
            write_reference(d, arrays)
        record_manifest(
            d, tool="Megatron-LM + megatron-core (GPTModel, DistributedOptimizer, save_checkpoint)",
            dists=dists, command=cmd, references=doc if case == ref_case else {},
            notes=notes, reference_case=ref_case, optimizer_format=what, training=train,
            reference_run=reference, parallel=run.parallel, vocab_size=60, padded_vocab_size=64,
            **facts,
        )  # fmt: skip
        print(f"wrote {d}", flush=True)
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=sorted(RUNS))
    ap.add_argument("--keep", help="a work folder to keep the runs' logs and saves in")
    a = ap.parse_args()
    ensure_megatron()
    for name, run in RUNS.items():
        if a.only in (None, name):
            make(a.out, name, run, a.keep and os.path.join(a.keep, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
