"""ColossalAI distributed checkpoints (`pytorch_model-meta-dist-*.json` + per-rank weight files),
written by ColossalAI's own HybridParallelPlugin (tp 2, 2 gloo CPU ranks) with the distributed
checkpoint IO of PR hpcaitech/ColossalAI#6181.

    python tests/real/make.py colossalai

That IO was never released: no colossalai on the package index has
`colossalai/checkpoint_io/distributed_checkpoint_utils.py` (0.4.7 .. 0.5.0, nightly 2025.7.12).
It exists at the PR's head, 7e880a13012686c3b2260b5d2278602412277b46, which is colossalai 0.4.7
(the pinned release) with seven files changed. The side venv must hold that code; this script
stops with a message when `distributed_checkpoint_utils` is missing, and records the sha256 of
the files it used in the manifest.

One world trains a tiny HF LlamaForCausalLM for two AdamW steps under the plugin, then saves it
with `booster.save_model(..., gather_dtensor=False)` three ways, one case each:
- `colossal_tp2_sharded_bin`: shard=True, .bin shards;
- `colossal_tp2_sharded_safetensors`: shard=True, use_safetensors=True;
- `colossal_tp2_unsharded`: shard=False (the save is called with the relative path "ckpt" from the
  case folder, as a user would; the metadata records that path).
The same model is also saved gathered (`gather_dtensor=True`, the released path) into a scratch
folder: that state dict, in HF names, is the reference for the params. Logits: the plugin's
module forward on 2 ranks. A second model whose vocab (120) is padded by shardformer
(`make_vocab_size_divisible_by`, 64 * tp) is saved the same way and what happens is recorded.

Shims (CPU): colossalai's CpuAccelerator raises or mis-calls on `get_rng_state`,
`manual_seed(_all)`, `synchronize`, `empty_cache`; they are pointed at torch's CPU RNG / no-ops.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import tempfile
import traceback

# this file is named like the package it drives: keep its folder off the path so that
# `import colossalai` finds the package (also in the spawned ranks, which re-run this top level)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402
import tools  # noqa: E402
import torch  # noqa: E402

PR_HEAD = "7e880a13012686c3b2260b5d2278602412277b46"
TP = 2
STD = 0.15
TOKENS = np.random.default_rng(5).integers(0, 128, size=(2, 10)).astype(np.int64)
CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
CASES = {
    "colossal_tp2_sharded_bin": dict(shard=True, use_safetensors=False, size_per_shard=0.03),
    "colossal_tp2_sharded_safetensors": dict(shard=True, use_safetensors=True, size_per_shard=0.03),
    "colossal_tp2_unsharded": dict(shard=False),
}
SHIMS = [
    "colossalai.accelerator.cpu_accelerator.CpuAccelerator: get_rng_state -> torch.get_rng_state() (it "
    "passes a device argument torch's CPU function does not take), manual_seed / manual_seed_all -> "
    "torch.manual_seed, synchronize / empty_cache -> no-ops (each raised 'not supported for cpu accelerator')",
    f"colossalai 0.4.7 with the seven files of PR hpcaitech/ColossalAI#6181 head {PR_HEAD} (never released)",
    "weights set before boosting: N(0, 0.15) for every linear/embedding weight, 1 + 0.2 * N(0, 1) for "
    "RMSNorm weights (seeded); then two AdamW steps (lr 1e-2) under the plugin, fp32",
]
PR_FILES = ["checkpoint_io/distributed_checkpoint_utils.py", "checkpoint_io/hybrid_parallel_checkpoint_io.py",
            "checkpoint_io/utils.py", "checkpoint_io/general_checkpoint_io.py",
            "booster/plugin/hybrid_parallel_plugin.py"]  # fmt: skip


def _shim_cpu_accelerator():
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    CpuAccelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    CpuAccelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
    CpuAccelerator.manual_seed_all = lambda self, seed: torch.manual_seed(seed)
    CpuAccelerator.synchronize = lambda self, device=None: None
    CpuAccelerator.empty_cache = lambda self: None


def _model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**(CONFIG | {"vocab_size": vocab})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else STD * noise)
    return model


def _boost(model):
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=TP, pp_size=1, precision="fp32", parallel_output=False))
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _worker(rank: int, world: int, port: int, out: str, scratch: str):
    import colossalai
    import torch.distributed as dist

    _shim_cpu_accelerator()
    colossalai.launch(rank=rank, world_size=world, host="127.0.0.1", port=port, backend="gloo")
    torch.manual_seed(0)
    booster, model, opt = _boost(_model(CONFIG["vocab_size"]))
    x = torch.from_numpy(TOKENS)
    for _ in range(2):
        loss = model(input_ids=x, labels=x).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    for case, kw in CASES.items():
        case_dir = os.path.join(out, case)
        os.chdir(case_dir)  # the unsharded metadata records the path save_model was given
        booster.save_model(model, "ckpt", gather_dtensor=False, **kw)
        dist.barrier()
    booster.save_model(model, os.path.join(scratch, "gathered.bin"), shard=False, gather_dtensor=True)
    dist.barrier()
    # the padded-vocab probe: 120 rows, padded by shardformer to a multiple of 64 * tp
    booster2, padded, _ = _boost(_model(120))
    probe = {"padded_rows_per_rank": int(padded.unwrap().model.embed_tokens.weight.shape[0])}
    try:
        booster2.save_model(padded, os.path.join(scratch, "padded"), shard=True, gather_dtensor=False)
        meta = [f for f in os.listdir(os.path.join(scratch, "padded")) if f.startswith(f"pytorch_model-meta-dist-{rank:05d}")]
        with open(os.path.join(scratch, "padded", meta[0])) as f:
            probe["metadata"] = json.load(f)["metadata"]["model.embed_tokens.weight"]
    except Exception as e:  # what the tool does with a padded vocab is the finding
        probe["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
    if rank == 0:
        torch.save({"logits": logits, "probe": probe}, os.path.join(scratch, "rank0.pt"))
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pr_code() -> dict:
    import colossalai

    root = os.path.dirname(colossalai.__file__)
    if not os.path.isfile(os.path.join(root, PR_FILES[0])):
        raise SystemExit(
            f"colossalai at {root} has no {PR_FILES[0]}: this generator needs the distributed checkpoint IO "
            f"of PR hpcaitech/ColossalAI#6181 (head {PR_HEAD}, on colossalai 0.4.7), which no release holds"
        )
    out = {}
    for f in PR_FILES:
        with open(os.path.join(root, f), "rb") as fh:
            out[f] = hashlib.sha256(fh.read()).hexdigest()
    return out


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    pr = _pr_code()
    for case in CASES:
        tools.fresh_case(out, case)
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_worker, args=(TP, _free_port(), out, scratch), nprocs=TP, join=True)
        got = torch.load(os.path.join(scratch, "rank0.pt"))
        gathered = torch.load(os.path.join(scratch, "gathered.bin"))
    refs = {k: v.float().numpy() for k, v in gathered.items()}
    refs |= {"logits": got["logits"].numpy(), "tokens": TOKENS}
    hf_config = CONFIG | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for case, kw in CASES.items():
        d = os.path.join(out, case)
        tools.write_reference(d, refs)
        with open(os.path.join(d, "hf_config.json"), "w") as f:  # the dist save writes no config.json
            json.dump(hf_config, f, indent=1)
        tools.record_manifest(
            d,
            tool="ColossalAI HybridParallelPlugin (tp 2) + distributed checkpoint IO (PR #6181)",
            dists=["torch", "colossalai", "transformers", "numpy", "safetensors"],
            command="python tests/real/make.py colossalai   (side venv holding PR #6181's colossalai, see the generator)",
            references={
                "model.* / lm_head.weight": "the same model saved by the released gathered path "
                "(booster.save_model(gather_dtensor=True, shard=False)), HF names, fp32",
                "logits": "HybridParallelModule forward on 2 tp ranks after the two steps (parallel_output=False: the plugin gathers the vocab), fp32 [batch, seq, vocab]",
                "tokens": "the token ids [batch, seq] (also the training batch)",
            },
            notes=SHIMS + [
                "no config.json: the distributed save writes none (save_config_file is only called on the "
                "gathered path); hf_config.json beside ckpt/ is the model's config",
                f"padded-vocab probe (vocab 120, tp 2): {json.dumps(got['probe'])}",
                "optimizer: the PR changes only the model's IO; save_optimizer writes the released gathered "
                "format (pytorch_optim.bin.index.json, states keyed by param index), not saved here",
            ],
            save_model_kwargs=dict(kw, gather_dtensor=False),
            pr_head=PR_HEAD,
            pr_files_sha256=pr,
        )
        print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
