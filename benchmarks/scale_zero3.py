"""A sparse DeepSpeed ZeRO-3 checkpoint of many ranks, shaped like a real run, from DeepSpeed's own files.

DeepSpeed 0.19.8 ZeRO-3 (`runtime/engine.py` `_save_checkpoint` / `_save_zero_checkpoint`,
`runtime/zero/stage3.py` `_rigid_state_dict`) writes, per DP rank r:

- `zero_pp_rank_{r}_mp_rank_00_model_states.pt`: `module` (the module's state dict, every
  partitioned param an EMPTY tensor `[0]`: one storage each), `buffer_names`, `param_shapes`
  (one OrderedDict name -> torch.Size per sub-group), `frozen_param_shapes`,
  `frozen_param_fragments`, `shared_params`, `global_steps`, `dp_world_size`, `ds_config`, ...;
- `zero_pp_rank_{r}_mp_rank_00_optim_states.pt`: `optimizer_state_dict` = {`zero_stage`
  (ZeroStageEnum.weights), `loss_scaler`, `partition_count`, `optimizer_state_dict` (torch AdamW
  state of the flat sub-groups: `step`, `exp_avg`, `exp_avg_sq`), `fp32_flat_groups` (rank r's
  fp32 partition of each sub-group: `ceil(numel/dp)` elements of every param, back to back)},
  `ds_config`, `ds_version`.

This script takes those objects from a real DeepSpeed ZeRO-3 save (`tests/fixtures/ds_writer.py`
variant `z3`, run here if `--template` is not given: DeepSpeed on CPU, 3 gloo ranks) and writes
them back for `--ranks` ranks of Llama 3.1 405B (HF names and shapes, 1137 params; the two param
groups HF's Trainer makes: weights with decay, the RMSNorm weights without; DeepSpeed's default
`sub_group_size` 1e9 elements then makes one sub-group per param group, since a rank holds 405B /
ranks elements), with every object DeepSpeed pickles kept as it is (ZeroStageEnum, LossScaler,
ds_config, torch.Size shapes, the param group hyperparameters). Files are written by `torch.save`
under `torch.serialization.skip_data` (the flat partitions and moments are FakeTensors of the real
sizes: torch writes every header and leaves the data as a hole, the files are sparse, 4.9 TB on
512 ranks takes ~0.2 GB of disk; torch writes a CRC-32 of 0 for a skipped record, and all data,
the AdamW `step` included, reads as zeros).

    python benchmarks/scale_zero3.py DIR --ranks 512 [--template DS_Z3_TAG_DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def template(root: str) -> str:
    """The tag folder of a real 3-rank DeepSpeed ZeRO-3 save (written under `root` once)."""
    tag = os.path.join(root, "ds_template", "z3", "global_step3")
    if not os.path.isdir(tag):
        env = dict(os.environ, DS_WRITER_VARIANTS="z3", DS_ACCELERATOR="cpu")
        subprocess.run([sys.executable, os.path.join(TREE, "tests", "fixtures", "ds_writer.py"),
                        os.path.join(root, "ds_template")], env=env, check=True, capture_output=True)
    return tag


def llama_groups() -> list[list[tuple[str, tuple[int, ...]]]]:
    """HF Trainer's param groups of Llama 3.1 405B: [with weight decay, without (norms)]."""
    import scale_sources

    params = scale_sources.llama_params(scale_sources.LLAMA_405B)
    decay = [(n, s) for n, s in params if not n.endswith("norm.weight")]
    return [decay, [(n, s) for n, s in params if n.endswith("norm.weight")]]


def write(root: str, ranks: int, template_dir: str, log=print) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    m0 = torch.load(os.path.join(template_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"), weights_only=False)
    o0 = torch.load(os.path.join(template_dir, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False)
    import scale_sources

    groups = llama_groups()
    names = [n for g in groups for n, _ in g]
    order = [n for n, _ in scale_sources.llama_params(scale_sources.LLAMA_405B)]  # the module's order
    per_rank = [sum(math.ceil(math.prod(s) / ranks) for _, s in g) for g in groups]
    fake = FakeTensorMode()
    with fake:
        flats = [torch.empty(n, dtype=torch.float32) for n in per_rank]
        m1 = [torch.empty(n, dtype=torch.float32) for n in per_rank]
        m2 = [torch.empty(n, dtype=torch.float32) for n in per_rank]
    hyper = {k: v for k, v in o0["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0].items()
             if k != "params"}
    ds_config = dict(m0["ds_config"], train_micro_batch_size_per_gpu=1, bf16={"enabled": True})
    model = dict(m0)
    model.update(
        module=collections.OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n in order),
        buffer_names=[],
        param_shapes=[collections.OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups],
        frozen_param_shapes=collections.OrderedDict(),
        frozen_param_fragments=collections.OrderedDict(),
        shared_params={},
        dp_world_size=ranks,
        global_steps=1000,
        global_samples=1000 * ranks,
        ds_config=ds_config,
    )
    osd = dict(o0["optimizer_state_dict"])
    osd.update(
        partition_count=ranks,
        optimizer_state_dict={
            "state": {g: {"step": torch.tensor(1000.0), "exp_avg": m1[g], "exp_avg_sq": m2[g]}
                      for g in range(len(groups))},
            "param_groups": [dict(hyper, weight_decay=wd, params=[g]) for g, wd in enumerate((0.1, 0.0))],
        },
        fp32_flat_groups=flats,
    )
    optim = dict(o0, optimizer_state_dict=osd, ds_config=ds_config)
    for r in range(ranks):
        model["module"] = collections.OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n in order)
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(model, os.path.join(root, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
            torch.save(optim, os.path.join(root, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        if r % 64 == 63:
            log(f"  {r + 1} ranks written ({time.perf_counter() - t0:.0f} s)")
    files = os.listdir(root)
    info = {
        "model": "Llama 3.1 405B, DeepSpeed 0.19.8 ZeRO-3 (template: ds_writer z3)",
        "ranks": ranks,
        "params": len(names),
        "sub_groups": len(groups),
        "model_states_bytes": sum(os.path.getsize(os.path.join(root, f)) for f in files if "model_states" in f),
        "optim_states_bytes": sum(os.path.getsize(os.path.join(root, f)) for f in files if "optim_states" in f),
        "disk_bytes": sum(os.stat(os.path.join(root, f)).st_blocks * 512 for f in files),
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(os.path.dirname(root), os.path.basename(root) + ".json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the tag folder to write (e.g. /tmp/scale_other/zero3_512/global_step1000)")
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--template", help="a real DeepSpeed ZeRO-3 tag folder (default: ds_writer z3 under DIR/..)")
    a = ap.parse_args(argv)
    tdir = a.template or template(os.path.dirname(os.path.abspath(a.dir)))
    print(json.dumps(write(a.dir, a.ranks, tdir, log=lambda s: print(s, file=sys.stderr))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
