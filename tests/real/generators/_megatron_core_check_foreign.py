"""Does Megatron-LM itself load what `hybridckpt export --to megatron --optimizer` writes from
ANOTHER framework's run, as the same model with the same optimizer state?

    # in the project venv: import torchtitan's own Qwen3 run and export it for Megatron
    python -m hybridckpt.cli import tests/real/cases/torchtitan_qwen3/ckpt /tmp/q/orbax \
        --config tests/real/cases/torchtitan_qwen3/config.json
    python -m hybridckpt.cli export /tmp/q/orbax /tmp/q/ours --to megatron --optimizer --pp 2
    # in the megatron_core side venv (~/.cache/hybridckpt-real/megatron_core):
    python tests/real/generators/_megatron_core_check_foreign.py --ours /tmp/q/ours [--record F]

One gloo rank (tp = pp = 1: another layout than the export's) builds a GPTModel and its
DistributedOptimizer with Megatron-LM's own code, from arguments that describe the case's HF
config.json (Qwen3: RMSNorm, SwiGLU, RoPE base 1e6, GQA, q/k layernorm, tied embeddings, the
local spec), then `load_checkpoint --load OURS` (megatron-core's resharding load of the
`fully_reshardable` state). Against torchtitan's own references of that run
(reference.safetensors: HF names, torchtitan's `to_hf`):
- every parameter, fp32 master and Adam moment Megatron holds equals torchtitan's, bit for bit
  (Megatron's fused q/k/v per query group and SwiGLU `[gate; up]` taken apart here by
  megatron's layouts; the vocabulary's padding rows zero);
- GPTModel's logits on torchtitan's fixed tokens equal torchtitan's forward (different kernels:
  relative 1e-5);
- the step Megatron resumes at is torchtitan's.
(The optimizer step itself is not compared: torchtitan's AdamW decays every parameter and
warms its LR up; Megatron's default groups exempt norms from weight decay and its scheduler
is the run's own: a different training recipe, not a different state.)
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
CASE = "torchtitan_qwen3"
TOL = 1e-5


def _argv(cfg: dict, seq: int) -> list[str]:
    """Megatron-LM arguments for the HF config `cfg` (Qwen3 / Llama without RoPE scaling)."""
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    argv = [
        "--num-layers", cfg["num_hidden_layers"], "--hidden-size", cfg["hidden_size"],
        "--num-attention-heads", heads, "--group-query-attention", "--num-query-groups", groups,
        "--kv-channels", cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "--ffn-hidden-size", cfg["intermediate_size"], "--seq-length", seq,
        "--max-position-embeddings", cfg["max_position_embeddings"], "--micro-batch-size", 1,
        "--global-batch-size", 1, "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", cfg["rms_norm_eps"],
        "--position-embedding-type", "rope", "--rotary-base", int(cfg["rope_theta"]), "--disable-bias-linear",
        "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer", "--vocab-size", cfg["vocab_size"],
        "--use-distributed-optimizer", "--lr", 0.01, "--min-lr", 0.0, "--lr-decay-style", "constant",
        "--train-iters", 10, "--weight-decay", 0.1, "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--adam-eps", 1e-8,
        "--clip-grad", 0.0, "--seed", 1234, "--attention-dropout", 0, "--hidden-dropout", 0,
        "--distributed-backend", "gloo", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--ckpt-format", "torch_dist", "--tensor-model-parallel-size", 1,
        "--pipeline-model-parallel-size", 1, "--override-opt-param-scheduler",
    ]  # fmt: skip
    if not cfg.get("tie_word_embeddings", False):
        argv.append("--untie-embeddings-and-output-weights")
    if cfg.get("model_type") == "qwen3":
        argv.append("--qk-layernorm")
    return [str(a) for a in argv]


def _as_hf(name: str, a, cfg: dict) -> dict:
    """Megatron's tensor `name` (tp = pp = 1 parameter names) under HF names."""
    import re

    import numpy as np

    if name == "embedding.word_embeddings.weight":
        return {"model.embed_tokens.weight": a[: cfg["vocab_size"]], "(padding rows)": a[cfg["vocab_size"] :]}
    if name == "output_layer.weight":
        return {"lm_head.weight": a[: cfg["vocab_size"]], "(padding rows)": a[cfg["vocab_size"] :]}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": a}
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    p, rest = f"model.layers.{m[1]}.", m[2]
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    if rest in simple:
        return {p + simple[rest]: a}
    if rest == "mlp.linear_fc1.weight":  # SwiGLU [gate; up]
        gate, up = np.split(a, 2)
        return {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    assert rest == "self_attention.linear_qkv.weight", name
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per = a.reshape(groups, heads // groups + 2, hd, -1)  # per query group: its q heads, k, v
    return {
        p + "self_attn.q_proj.weight": per[:, :-2].reshape(heads * hd, -1),
        p + "self_attn.k_proj.weight": per[:, -2].reshape(groups * hd, -1),
        p + "self_attn.v_proj.weight": per[:, -1].reshape(groups * hd, -1),
    }


def _check(ours: str, result: str) -> None:
    """Under torchrun (one rank): load, compare; rank 0 writes `result`."""
    import _megatron_core_run as run
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    case = os.path.join(HERE, "..", "cases", CASE)
    ref = load_file(os.path.join(case, "reference.safetensors"))
    with open(os.path.join(case, "config.json")) as f:
        cfg = json.load(f)
    tokens = torch.from_numpy(ref["tokens"].astype(np.int64))
    argv = [*_argv(cfg, tokens.shape[1]), "--load", ours, "--exit-on-missing-checkpoint"]
    model, optimizer, _ = run._setup(argv)
    from megatron.training import get_args

    args = get_args()
    params = run._named(model)
    owned = run._owned(optimizer, params)
    states = {n: o._get_main_param_and_optimizer_states(params[n]) for n, (o, _, _) in owned.items()}
    lines, ok = [], True

    def compare(kind: str, got: dict) -> None:
        nonlocal ok
        hf: dict = {}
        for n, a in got.items():
            for k, v in _as_hf(n, a, cfg).items():
                if k == "(padding rows)":
                    hf.setdefault(k, []).append(v)
                else:
                    hf[k] = v
        names = sorted(k[len(kind) + 1 :] for k in ref if k.startswith(kind + "/"))
        same = [k for k in names if k in hf and np.array_equal(hf[k], ref[f"{kind}/{k}"])]
        zero = all(not np.any(v) for v in hf.get("(padding rows)", []))
        extra = sorted(set(hf) - set(names) - {"(padding rows)"})
        ok &= len(same) == len(names) and zero and not extra
        lines.append(f"{kind}: {len(same)}/{len(names)} bitwise torchtitan's (HF names){'' if not extra else f', UNEXPECTED {extra}'}; "
                     f"vocabulary padding rows {'zero' if zero else 'NOT zero'}")  # fmt: skip

    compare("param", {n: p.detach().numpy().copy() for n, p in params.items()})
    masters = {n: st["param"].detach().reshape(params[n].shape).numpy().copy() for n, st in states.items()}
    ok &= len(masters) == len(params)
    compare("param", masters)
    lines[-1] = f"fp32 masters ({len(masters)} of {len(params)} params): " + lines[-1]
    for slot in ("exp_avg", "exp_avg_sq"):
        compare(slot, {n: st[slot].detach().reshape(params[n].shape).numpy().copy() for n, st in states.items()})
    steps = sorted({float(st["step"]) for o in run._optimizers(optimizer) for st in o.optimizer.state.values()})
    want = float(ref["step"].reshape(-1)[0])
    ok &= steps == [want] and args.iteration == int(want)
    lines.append(f"optimizer steps {steps}, iteration {args.iteration} (torchtitan: {want})")

    seq = tokens.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    for m in model:
        m.eval()
    with torch.no_grad():
        logits = model[0](tokens, position_ids, mask).float().numpy()[..., : cfg["vocab_size"]]
    w = float(np.abs(logits - ref["logits"]).max() / np.abs(ref["logits"]).max())
    ok &= w <= TOL
    lines.append(f"GPTModel's logits on torchtitan's fixed tokens vs torchtitan's forward: max relative "
                 f"difference {w:.3g} (tolerance {TOL})")  # fmt: skip
    if torch.distributed.get_rank() == 0:
        with open(result, "w") as f:
            json.dump({"ok": bool(ok), "lines": lines}, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True, help="our export --to megatron of torchtitan_qwen3")
    ap.add_argument("--record", help="write the result as JSON here")
    ap.add_argument("--exported-with", default="", help="the export's options, for the record (e.g. '--pp 2')")
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
    result = os.path.join(tempfile.mkdtemp(prefix="megatron-foreign-"), "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-port=29521",
           os.path.abspath(__file__), "--ours", a.ours, "--under-torchrun", result]  # fmt: skip
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if r.returncode or not os.path.exists(result):
        print(r.stdout[-4000:], r.stderr[-8000:])
        return 1
    with open(result) as f:
        res = json.load(f)
    for line in res["lines"]:
        print(f"{CASE} (Megatron, loaded at tp1 pp1): {line}")
    print("LOADED EXACTLY" if res["ok"] else "DIFFERENT")
    if export_digest.digest(a.ours) != before:
        print(f"{a.ours} changed while Megatron loaded it: no record")
        return 1
    if a.record:
        import tools

        doc = {"check": "Megatron-LM load_checkpoint of export --to megatron --optimizer of a torchtitan run",
               "case": CASE, "loaded_at": {"tp": 1, "pp": 1}, "exported_with": a.exported_with, "ok": res["ok"],
               "export": export_digest.record(json.loads(a.export_commands), a.ours),
               "lines": res["lines"], "versions": tools.versions("megatron-core", "torch"),
               "command": "python tests/real/generators/_megatron_core_check_foreign.py --ours OURS"}  # fmt: skip
        with open(a.record, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
