"""A PaddleFormers FlexCheckpoint step folder of many ranks, its metadata written by Paddle itself.

Run with a Python where paddlepaddle 3.3.1 imports (the corpus's side venv
`~/.cache/hybridckpt-real/paddleformers`). PaddleFormers 1.x saves a step as three
FlexCheckpoints (`model_state/`, `optimizer_state/`, `master_weight/`), each by Paddle's
`dist.save_state_dict` (python/paddle/distributed/flex_checkpoint/dcp/save_state_dict.py): every
rank describes its local blocks (`LocalTensorMetadata`, `LocalTensorIndex`), the ranks' lists are
all-gathered, merged (`merge_state_dict_metadata`), deduplicated (`balanced_dedup_key_in_dict`,
`dedup_key_in_dict`) and written by `paddle.save(Metadata(...))` (`write_to_file_if_empty`).
This script runs those same functions on the lists of every rank in one process (the gather is
the list), for Llama 3.1 405B under PaddleFormers' names (`model.layers.N.self_attn.q_proj.weight`,
Paddle's `[in, out]` weights) with TP (`--tp`, column-parallel q/k/v/gate/up split on dim 1,
row-parallel o/down on dim 0, the embedding on the vocab, `lm_head` on dim 1, norms replicated),
PP (`--pp`, layers split evenly) and sharding stage1 v2 (`--sharding`): the moments and fp32
masters of a (tp, pp) rank's params, flattened and joined in param order, cut into `sharding`
equal ranges, each param's piece on a rank a flattened block (the real case
`paddleformers_untied_bf16_sharding2` shows the block form; the 256-element alignment
PaddleFormers pads each param to is left out). The `.distcp` data files are written EMPTY
(opening a FlexCheckpoint reads only its metadata), or with `--sparse` as `save_state_dict` writes
them: per rank `paddle.save` of its local state dict after `dedup_tensor` (the keys the merged
metadata stores in that rank's file, in the rank's order; bf16 as uint16 bits, flattened pieces
1-D), by `scale_paddle.flex_data_file` (paddle.save's bytes with the arrays as holes; the beta
pows hold beta ** (step + 1)), so `hybridckpt inspect` reads them as it reads a real run's.

    ~/.cache/hybridckpt-real/paddleformers/bin/python benchmarks/scale_flex.py DIR --tp 8 --pp 8 --sharding 8 [--sparse]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scale_paddle import beta_pow, flex_data_file  # noqa: E402

LLAMA_405B = {"hidden": 16384, "ffn": 53248, "layers": 126, "heads": 128, "kv_heads": 8, "vocab": 128256}


def params(c: dict, tp: int, pp: int, p: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(name, global shape [in, out], TP-split dim or None) of stage `p`."""
    h, f, hd = c["hidden"], c["ffn"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * hd
    per = c["layers"] // pp
    out = [("model.embed_tokens.weight", (c["vocab"], h), 0)] if p == 0 else []
    for i in range(p * per, (p + 1) * per):
        L = f"model.layers.{i}."
        out += [(L + "self_attn.q_proj.weight", (h, h), 1), (L + "self_attn.k_proj.weight", (h, kv), 1),
                (L + "self_attn.v_proj.weight", (h, kv), 1), (L + "self_attn.o_proj.weight", (h, h), 0),
                (L + "mlp.gate_proj.weight", (h, f), 1), (L + "mlp.up_proj.weight", (h, f), 1),
                (L + "mlp.down_proj.weight", (f, h), 0), (L + "input_layernorm.weight", (h,), None),
                (L + "post_attention_layernorm.weight", (h,), None)]
    if p == pp - 1:
        out += [("model.norm.weight", (h,), None), ("lm_head.weight", (h, c["vocab"]), 1)]
    return out


def _shard(shape, dim, tp, t):
    """(offset, local shape) of TP rank t's block."""
    if dim is None:
        return (0,) * len(shape), tuple(shape)
    n = shape[dim] // tp
    off = [0] * len(shape)
    off[dim] = t * n
    loc = list(shape)
    loc[dim] = n
    return tuple(off), tuple(loc)


def write(root: str, tp: int, pp: int, sh: int, log=print, sparse: bool = False, step: int = 1000) -> dict:
    import paddle  # noqa: F401
    from paddle.distributed.flex_checkpoint.dcp.metadata import (
        LocalTensorIndex,
        LocalTensorMetadata,
        Metadata,
    )
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import (
        balanced_dedup_key_in_dict,
        dedup_key_in_dict,
    )
    from paddle.distributed.flex_checkpoint.dcp.utils import (
        merge_state_dict_metadata,
        write_to_file_if_empty,
    )

    t0 = time.perf_counter()
    world = tp * pp * sh
    c = LLAMA_405B
    states = {"model_state": ([], [], []), "optimizer_state": ([], [], []), "master_weight": ([], [], [])}
    entries: dict = {k: [] for k in states}  # state -> per rank [(index, key, stored shape, code, data)]
    pows = {".beta1_pow_acc_0": beta_pow(0.9, step), ".beta2_pow_acc_0": beta_pow(0.999, step)} if sparse else {}

    def add(state, rank_md, rank_st, key, off, loc, dtype, gshape, flat=None):
        fname = f"{rank}_0.distcp"
        md = LocalTensorMetadata(global_offset=off, local_shape=loc, dtype=dtype, global_shape=gshape,
                                 is_flattened=flat is not None, flattened_range=flat)
        rank_md.setdefault(key, []).append(md)
        idx = LocalTensorIndex(tensor_key=key, global_offset=off, is_flattened=flat is not None,
                               flattened_range=flat, local_shape=loc)
        rank_st[idx] = fname
        if sparse:
            stored = (flat[1] - flat[0],) if flat is not None else loc
            code = "u2" if dtype == "bfloat16" else "f4"
            entries[state][-1].append((idx, key, stored, code, pows.get(key[key.rfind("."):])))

    for rank in range(world):
        t, p, s = rank % tp, (rank // tp) % pp, rank // (tp * pp)
        locs = {k: ({}, {}, {}) for k in states}  # state_dict_metadata, storage, flat mapping
        for k in entries if sparse else ():
            entries[k].append([])
        ps = params(c, tp, pp, p)
        total = sum(math.prod(_shard(g, d, tp, t)[1]) for _, g, d in ps)
        lo, hi = s * math.ceil(total / sh), min(total, (s + 1) * math.ceil(total / sh))
        pos = 0
        for name, g, d in ps:
            off, loc = _shard(g, d, tp, t)
            m, st, fm = locs["model_state"]
            add("model_state", m, st, name, off, loc, "bfloat16", g)
            fm[name] = (name,)
            n = math.prod(loc)
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:  # this sharding rank's piece of the param's flattened TP block
                for state, keys in (("optimizer_state", (".moment1_0", ".moment2_0")), ("master_weight", (".w_0",))):
                    m, st, fm = locs[state]
                    for k in keys:
                        add(state, m, st, name + k, off, loc, "float32", g, (a - pos, b - pos))
                        fm[name + k] = (name + k,)
                m, st, fm = locs["optimizer_state"]
                for k in (".beta1_pow_acc_0", ".beta2_pow_acc_0"):
                    add("optimizer_state", m, st, name + k, (0,), (1,), "float32", (1,))
                    fm[name + k] = (name + k,)
            pos += n
        for k, (mds, sts, fms) in states.items():
            mds.append(locs[k][0])
            sts.append(locs[k][1])
            fms.append(locs[k][2])
        if rank % 64 == 63:
            log(f"  {rank + 1} ranks described ({time.perf_counter() - t0:.0f} s)")
    info = {"model": "Llama 3.1 405B, PaddleFormers FlexCheckpoint (paddle 3.3.1's own metadata code)",
            "tp": tp, "pp": pp, "sharding": sh, "ranks": world}
    for k, (mds, sts, fms) in states.items():
        md = Metadata()
        md.state_dict_metadata = merge_state_dict_metadata(mds)
        md.storage_metadata = balanced_dedup_key_in_dict(sts)
        md.flat_mapping = dedup_key_in_dict(fms)
        d = os.path.join(root, k)
        os.makedirs(d, exist_ok=True)
        write_to_file_if_empty(md, os.path.join(d, "0.metadata"))
        for r in range(world):
            fname = f"{r}_0.distcp"
            if not sparse:
                open(os.path.join(d, fname), "wb").close()
                continue
            mine = [(key, shape, code, f"{k}_tensor_{i}", data)
                    for i, (idx, key, shape, code, data) in enumerate(entries[k][r])
                    if md.storage_metadata[idx] == fname]
            flex_data_file(os.path.join(d, fname), mine)
            entries[k][r] = None
        info[k] = {"keys": len(md.state_dict_metadata), "blocks": len(md.storage_metadata),
                   "metadata_bytes": os.path.getsize(os.path.join(d, "0.metadata"))}
        log(f"  {k}: {info[k]} ({time.perf_counter() - t0:.0f} s)")
    info["seconds"] = time.perf_counter() - t0
    with open(os.path.join(root, "scale_source.json"), "w") as fh:
        json.dump(info, fh, indent=1)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the step folder to write (e.g. /tmp/scale_other/flex_512/checkpoint-1000)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=7)
    ap.add_argument("--sharding", type=int, default=8)
    ap.add_argument("--sparse", action="store_true", help="write the data files (holes), not empty files")
    a = ap.parse_args(argv)
    print(json.dumps(write(a.dir, a.tp, a.pp, a.sharding, log=lambda s: print(s, file=sys.stderr),
                           sparse=a.sparse)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
