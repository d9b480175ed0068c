"""A sparse PaddleNLP hybrid-parallel checkpoint of many ranks (Llama 3.1 405B), and the sparse
data files of a FlexCheckpoint: paddle.save's bytes with the arrays as holes.

PaddleNLP's Trainer (paddlenlp/trainer/trainer.py `_save_checkpoint`, trainer/utils/
sharding_io.py) saves a hybrid run's `checkpoint-<step>/` as, per (tp, pp) rank,
`model_state.tpXX_ppYY.pdparams` (`paddle.save` of the stage's state dict: structured names
`llama.layers.N...`, Paddle `[in, out]` weights, bf16 as uint16 bits, and the
`StructuredToParameterName@@` table to the rank's `param.name`s) and, per (tp, pp, sharding)
rank, `optimizer.tpXX_ppYY_shardZZ.pdopt` (`paddle.save` of the optimizer's state dict: the
AdamW accumulators `<param.name>_fp32_master_0_{moment1,moment2,beta1_pow_acc,beta2_pow_acc}_0`
of the params the sharding rank owns, `master_weights` {param.name: fp32} and `LR_Scheduler`;
not a state dict, so every tensor pickled as `(name, ndarray)`). The layout here is the one
`tests/fixtures/paddle_writer.py` writes and `tests/formats/test_paddle.py` reads (its
structure checked against paddle 3.3.1): TP as PaddleNLP's `_get_tensor_parallel_mappings`
(q/k/v/gate/up on the last axis, o/down on axis 0, the embedding on the vocab, `lm_head` on axis
1, norms replicated), PP layers split evenly (stage 0 the embedding, the last the norm and
`lm_head`), sharding stage1 v1 (each param's optimizer state on the least-loaded sharding rank,
`DygraphShardingOptimizer._partition_parameters`), param names restarting on every (tp, pp)
(`column_parallel_linear_N.w_0`, ...). Files are written by `paddle_pickle.dump`: the bytes
paddle.save writes (`tests/jobs/test_paddle_pickle.py`), the arrays holes (the beta pows, 4
bytes each, hold beta ** (step + 1) as Paddle's fp32 kernel gives it). Not written:
`model_meta.json` and `save_sharded_model`'s per-shard model files, `training_args.bin`,
`rng_state`, `scheduler.pdparams`.

`flex_data_files` writes a FlexCheckpoint rank's `.distcp` (`paddle.save` of the rank's local
state dict after `dedup_tensor`: the keys the merged metadata stores in that rank's file) for
`scale_flex.py --sparse`.

    python benchmarks/scale_paddle.py DIR --tp 8 --pp 2 --sharding 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paddle_pickle as pp  # noqa: E402

LLAMA_405B = {"hidden": 16384, "ffn": 53248, "layers": 126, "heads": 128, "kv_heads": 8, "vocab": 128256}
BETAS = (0.9, 0.999)


def beta_pow(beta: float, step: int) -> bytes:
    """The `[1]` fp32 accumulator after `step` steps (fp32 multiplications, as Paddle's kernel)."""
    return np.cumprod(np.full(step + 1, beta, dtype=np.float32), dtype=np.float32)[-1:].tobytes()


def stage_params(c: dict, tp: int, pp_: int, p: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(structured name, TP-local shape [in, out], param.name) of stage `p` of one tp rank."""
    h, f, hd = c["hidden"], c["ffn"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * hd
    per = c["layers"] // pp_
    counters: dict[str, int] = {}

    def name(kind):
        counters[kind] = counters.get(kind, 0) + 1
        return f"{kind}_{counters[kind] - 1}.w_0"

    col, row = "column_parallel_linear", "row_parallel_linear"
    out = [("llama.embed_tokens.weight", (c["vocab"] // tp, h), name("vocab_parallel_embedding"))] if p == 0 else []
    for i in range(p * per, (p + 1) * per):
        L = f"llama.layers.{i}."
        out += [(L + "self_attn.q_proj.weight", (h, h // tp), name(col)),
                (L + "self_attn.k_proj.weight", (h, kv // tp), name(col)),
                (L + "self_attn.v_proj.weight", (h, kv // tp), name(col)),
                (L + "self_attn.o_proj.weight", (h // tp, h), name(row)),
                (L + "mlp.gate_proj.weight", (h, f // tp), name(col)),
                (L + "mlp.up_proj.weight", (h, f // tp), name(col)),
                (L + "mlp.down_proj.weight", (f // tp, h), name(row)),
                (L + "input_layernorm.weight", (h,), name("create_parameter")),
                (L + "post_attention_layernorm.weight", (h,), name("create_parameter"))]
    if p == pp_ - 1:
        out += [("llama.norm.weight", (h,), name("create_parameter")),
                ("lm_head.weight", (h, c["vocab"] // tp), name("llama_lm_head"))]
    return out


def greedy(sizes: list[int], n: int) -> list[int]:
    """DygraphShardingOptimizer._partition_parameters: each param to the least-loaded rank."""
    load, owner = [0] * n, []
    for s in sizes:
        r = load.index(min(load))
        owner.append(r)
        load[r] += s
    return owner


def suffix(t: int, p: int, s: int | None, tp: int, pp_: int, sh: int) -> str:
    parts = ([f"tp{t:02d}"] if tp > 1 else []) + ([f"pp{p:02d}"] if pp_ > 1 else [])
    parts += [f"shard{s:02d}"] if s is not None and sh > 1 else []
    return ("." + "_".join(parts)) if parts else ""


def config(c: dict, tp: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
            "hidden_size": c["hidden"], "intermediate_size": c["ffn"], "num_hidden_layers": c["layers"],
            "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
            "vocab_size": c["vocab"], "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "tensor_parallel_degree": tp,
            "paddlenlp_version": "3.0.0b4"}


def write_hybrid(root: str, tp: int, pp_: int, sh: int, *, c: dict = LLAMA_405B, step: int = 1000,
                 log=print) -> dict:
    """Write the `checkpoint-<step>`-like folder `root`; returns a summary."""
    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(config(c, tp), f, indent=2)
    with open(os.path.join(root, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "epoch": 0.5, "log_history": []}, f)
    pows = {"beta1_pow_acc": beta_pow(BETAS[0], step), "beta2_pow_acc": beta_pow(BETAS[1], step)}
    nbytes = holes = files = 0
    for p in range(pp_):
        for t in range(tp):
            params = stage_params(c, tp, pp_, p)
            model = {n: pp.Array(shape, "u2") for n, shape, _ in params}
            info = pp.dump(pp.state_dict(model, {n: pname for n, _, pname in params}),
                           os.path.join(root, f"model_state{suffix(t, p, None, tp, pp_, sh)}.pdparams"))
            nbytes, holes, files = nbytes + info["bytes"], holes + info["holes"], files + 1
            owner = greedy([math.prod(shape) for _, shape, _ in params], sh)
            for s in range(sh):
                mine = [(shape, pname) for (_, shape, pname), o in zip(params, owner, strict=True) if o == s]
                opt: dict = {}
                for acc in ("moment1", "moment2"):
                    for shape, pname in mine:
                        k = f"{pname}_fp32_master_0_{acc}_0"
                        opt[k] = pp.Named(k, pp.Array(shape, "f4"))
                for acc, value in pows.items():
                    for _, pname in mine:
                        k = f"{pname}_fp32_master_0_{acc}_0"
                        opt[k] = pp.Named(k, pp.Array((1,), "f4", value))
                opt["master_weights"] = {pname: pp.Named(f"{pname}_fp32_master_0", pp.Array(shape, "f4"))
                                         for shape, pname in mine}
                opt["LR_Scheduler"] = {"last_epoch": step, "last_lr": 3e-05}
                info = pp.dump(opt, os.path.join(root, f"optimizer{suffix(t, p, s, tp, pp_, sh)}.pdopt"))
                nbytes, holes, files = nbytes + info["bytes"], holes + info["holes"], files + 1
        log(f"  stage {p + 1}/{pp_} written ({time.perf_counter() - t0:.0f} s)")
    out = {"model": "Llama 3.1 405B, PaddleNLP hybrid (bf16, AdamW fp32 masters, sharding stage1 v1)",
           "tp": tp, "pp": pp_, "sharding": sh, "ranks": tp * pp_ * sh, "files": files,
           "bytes": nbytes, "holes": holes, "seconds": time.perf_counter() - t0}
    with open(os.path.join(root, "scale_source.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def flex_data_file(path: str, entries: list[tuple[str, tuple[int, ...], str, str, bytes | None]]) -> dict:
    """One FlexCheckpoint `.distcp`: `paddle.save` of {key: array} (a state dict), `entries` the
    rank's (key, local shape, numpy code, tensor name, data or None) in its state dict order."""
    arrays = {k: pp.Array(shape, code, data) for k, shape, code, _, data in entries}
    return pp.dump(pp.state_dict(arrays, {k: name for k, _, _, name, _ in entries}), path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the checkpoint folder to write (e.g. /tmp/s/pd_64/checkpoint-1000)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--sharding", type=int, default=4)
    ap.add_argument("--step", type=int, default=1000)
    a = ap.parse_args(argv)
    if LLAMA_405B["layers"] % a.pp:
        ap.error(f"--pp must divide {LLAMA_405B['layers']} (the layers are split evenly)")
    print(json.dumps(write_hybrid(a.dir, a.tp, a.pp, a.sharding, step=a.step,
                                  log=lambda s: print(s, file=sys.stderr))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
