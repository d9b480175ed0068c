"""Sparse Megatron-LM legacy per-rank folders of many TP x PP ranks, from a real Megatron save's objects.

Megatron-LM (`--ckpt-format torch`, megatron-core 0.19.2: training/checkpointing.py
`save_checkpoint`, `generate_state_dict`) writes, per (tp, pp) rank, `iter_N/mp_rank_TT_PPP/`:

- `model_optim_rng.pt`: `args` (the argparse Namespace, ~900 fields), `checkpoint_version`,
  `iteration`, `model` (the stage's state dict: local layer numbers, TP shards, every param a
  view of the rank's one contiguous param buffer, `_extra_state` None without TE),
  `optimizer` (the distributed optimizer's param groups), `opt_param_scheduler`, `rng_state`,
  `num_floating_point_operations_so_far`;
- `distrib_optim.pt`: `{buckets_coalesced: True, 0: {(param dtype, grad dtype): {param,
  exp_avg, exp_avg_sq (fp32 [numel_unpadded]), numel_unpadded}}}`: the DP ranks' shards
  gathered, params in reverse order, each start padded to 64 elements.

This script loads those objects from the real Megatron-LM save of the corpus
(`tests/real/cases/megatron_lm_dense_torch`, rank mp_rank_00_000; megatron's own classes in
`args` (ModelType, AttnBackend enums) are re-pickled under their own names without importing
megatron) and writes them back for Llama 3.1 405B (126 layers, hidden 16384, ffn 53248, 128
heads, 8 KV groups, vocab 128256 padded to a multiple of 128 x TP; bf16 params, fp32 optimizer)
on `--tp` x `--pp` rank folders (`args` updated: sizes, parallelism, bf16). Files are written
by `torch.save` under `torch.serialization.skip_data` (FakeTensors: headers exact, data holes,
a CRC-32 of 0 for skipped records, all data reads as zeros).

    python benchmarks/scale_megatron.py DIR --tp 8 --pp 63 [--dp 8]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import os
import pickle
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
TEMPLATE = os.path.join(TREE, "tests", "real", "cases", "megatron_lm_dense_torch", "ckpt", "iter_0000003",
                        "mp_rank_00_000")
LLAMA_405B = {"num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248, "num_attention_heads": 128,
              "num_query_groups": 8, "kv_channels": 128, "vocab_size": 128256, "seq_length": 8192,
              "max_position_embeddings": 131072, "rotary_base": 500000, "make_vocab_size_divisible_by": 128}


def _fake_class(mod: str, name: str):
    """A stand-in for megatron's class `mod.name` that pickles back as itself (REDUCE of its args)."""
    parts = mod.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    m = sys.modules[mod]
    if not hasattr(m, name):
        def __init__(self, *a):
            self._args = a

        def __reduce__(self):
            return type(self), self._args

        setattr(m, name, type(name, (), {"__module__": mod, "__qualname__": name, "__init__": __init__,
                                         "__reduce__": __reduce__}))
    return getattr(m, name)


class _Unpickler(pickle.Unpickler):
    def find_class(self, mod, name):
        if mod.split(".")[0] == "megatron":
            return _fake_class(mod, name)
        return super().find_class(mod, name)


_PICKLE = types.ModuleType("megatron_pickle")
_PICKLE.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
_PICKLE.Unpickler = _Unpickler


def _load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)


def stage_params(c: dict, tp: int, pp: int, p: int) -> list[tuple[str, tuple[int, ...] | None]]:
    """(name, this TP rank's shape or None for `_extra_state`) of pipeline stage `p`, in
    state-dict order (mcore GPT, local layer numbers)."""
    h, f, kv = c["hidden_size"], c["ffn_hidden_size"], c["kv_channels"]
    heads, groups = c["num_attention_heads"], c["num_query_groups"]
    vocab = c["padded_vocab_size"]
    per = c["num_layers"] // pp
    out = [("embedding.word_embeddings.weight", (vocab // tp, h))] if p == 0 else []
    for i in range(per):
        L = f"decoder.layers.{i}."
        out += [
            (L + "input_layernorm.weight", (h,)),
            (L + "self_attention.linear_proj.weight", (h, heads * kv // tp)),
            (L + "self_attention.linear_proj._extra_state", None),
            (L + "self_attention.linear_qkv.weight", ((heads + 2 * groups) * kv // tp, h)),
            (L + "self_attention.linear_qkv._extra_state", None),
            (L + "pre_mlp_layernorm.weight", (h,)),
            (L + "mlp.linear_fc1.weight", (2 * f // tp, h)),
            (L + "mlp.linear_fc1._extra_state", None),
            (L + "mlp.linear_fc2.weight", (h, f // tp)),
            (L + "mlp.linear_fc2._extra_state", None),
        ]
    if p == pp - 1:
        out += [("decoder.final_layernorm.weight", (h,)), ("output_layer.weight", (vocab // tp, h)),
                ("output_layer._extra_state", None)]
    return out


def buffer_layout(shapes: list[tuple[int, ...]], dp: int) -> tuple[list[int], int, int]:
    """Megatron's param buffer: params in REVERSE order, each start padded up to 64 elements;
    (start of each param in the given order, numel_unpadded, the buffer's padded size)."""
    starts = [0] * len(shapes)
    pos = 0
    for i in reversed(range(len(shapes))):
        pos = -(-pos // 64) * 64
        starts[i] = pos
        pos += math.prod(shapes[i])
    unit = math.lcm(dp, 128)
    return starts, pos, -(-pos // unit) * unit


def write(root: str, tp: int, pp: int, dp: int, log=print) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    m0 = _load(os.path.join(TEMPLATE, "model_optim_rng.pt"))
    c = dict(LLAMA_405B)
    unit = c["make_vocab_size_divisible_by"] * tp
    c["padded_vocab_size"] = -(-c["vocab_size"] // unit) * unit
    args = copy.copy(m0["args"])
    for k, v in c.items():
        setattr(args, k, v)
    for k, v in {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                 "transformer_pipeline_model_parallel_size": pp, "data_parallel_size": dp,
                 "world_size": tp * pp * dp, "encoder_num_layers": c["num_layers"],
                 "encoder_seq_length": c["seq_length"], "bf16": True, "params_dtype": torch.bfloat16,
                 "expert_tensor_parallel_size": tp}.items():
        setattr(args, k, v)
    it = os.path.join(root, "iter_0001000")
    os.makedirs(it, exist_ok=True)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("1000")
    fake = FakeTensorMode()
    for p in range(pp):
        spec = stage_params(c, tp, pp, p)
        shapes = [s for _, s in spec if s is not None]
        starts, unpadded, padded = buffer_layout(shapes, dp)
        with fake:
            buf = torch.empty(padded, dtype=torch.bfloat16)
            views = [buf[a:a + math.prod(s)].view(s) for a, s in zip(starts, shapes, strict=True)]
            flats = {k: torch.empty(unpadded, dtype=torch.float32) for k in ("param", "exp_avg", "exp_avg_sq")}
        model, k = collections.OrderedDict(), 0
        for name, s in spec:
            if s is None:
                model[name] = None
            else:
                model[name] = views[k]
                k += 1
        state = dict(m0, args=args, iteration=1000, model=model)
        distrib = {"buckets_coalesced": True, 0: {(torch.bfloat16, torch.float32): dict(flats, numel_unpadded=unpadded)}}
        for t in range(tp):
            d = os.path.join(it, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(d, exist_ok=True)
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(state, os.path.join(d, "model_optim_rng.pt"))
                torch.save(distrib, os.path.join(d, "distrib_optim.pt"))
        log(f"  stage {p + 1}/{pp} ({time.perf_counter() - t0:.0f} s)")
    files = [os.path.join(dp_, f) for dp_, _, fs in os.walk(it) for f in fs]
    info = {"model": "Llama 3.1 405B, Megatron-LM legacy torch format (template: megatron_lm_dense_torch)",
            "tp": tp, "pp": pp, "dp": dp, "rank_folders": tp * pp, "files": len(files),
            "bytes": sum(os.path.getsize(f) for f in files),
            "disk_bytes": sum(os.stat(f).st_blocks * 512 for f in files),
            "seconds": time.perf_counter() - t0}
    with open(os.path.join(root, "scale_source.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=63)
    ap.add_argument("--dp", type=int, default=8)
    a = ap.parse_args(argv)
    print(json.dumps(write(a.dir, a.tp, a.pp, a.dp, log=lambda s: print(s, file=sys.stderr))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
