"""What `paddle.save` writes for payloads of 64 KiB and more: the record behind the sparse writer.

    ~/.cache/hybridckpt-real/paddleformers/bin/python tests/real/generators/paddle_save_layout.py

paddlepaddle 3.3.1 (the paddleformers side venv: `paddleformers.requirements.txt`, numpy 1.26.4)
saves, with `paddle.save` at its default protocol 4, two files shaped like a PaddleNLP hybrid
rank's: a model state dict (bf16 and fp32 params, the big ones over pickle's 64 KiB frame target,
so written outside any frame) and an optimizer dict holding `master_weights` and `LR_Scheduler`
(not a state dict: every tensor pickled as `(name, ndarray)`). Every array is ZEROS, so the file
equals one whose payloads are holes. The corpus files (payloads under 64 KiB) are compared byte
for byte directly; these two are too big for the corpus (and all zeros), so the record
`tests/real/paddle_save_layout.json` keeps, per file, its SHA-256, its size and its structure
(keys in order, tensor names, shapes, numpy dtype codes) as paddle's own unpickling reads it back;
`tests/jobs/test_paddle_pickle.py` rebuilds each from the structure with
`benchmarks/paddle_pickle.py` (holes for the payloads) and compares the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import tempfile

import numpy as np
import paddle

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "paddle_save_layout.json")


def describe(x):
    """The structure of an unpickled paddle.save object (no array values: they are zeros)."""
    if isinstance(x, np.ndarray):
        assert not x.any()
        return {"array": list(x.shape), "code": x.dtype.str[1:]}
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], np.ndarray):
        return {"named": x[0], "value": describe(x[1])}
    if isinstance(x, dict):
        return {"dict": [[k, describe(v)] for k, v in x.items()]}
    assert isinstance(x, (int, float, str)) or x is None, type(x)
    return {"value": x}


def main() -> int:
    paddle.set_device("cpu")
    h, f = 160, 128
    z = paddle.zeros
    model = {
        "llama.embed_tokens.weight": z([256, h], dtype="bfloat16"),  # 80 KiB
        "llama.layers.0.self_attn.q_proj.weight": z([h, h], dtype="bfloat16"),  # 50 KiB
        "llama.layers.0.mlp.up_proj.weight": z([h, f], dtype="float32"),  # 80 KiB
        "llama.layers.0.input_layernorm.weight": z([h], dtype="bfloat16"),
        "lm_head.weight": z([h, 512], dtype="float32"),  # 320 KiB
    }
    opt = {}
    for p, shape in (("embedding_0.w_0", [256, h]), ("linear_0.w_0", [h, f])):
        for acc in ("moment1", "moment2"):
            opt[f"{p}_fp32_master_0_{acc}_0"] = z(shape, dtype="float32")
    for p in ("embedding_0.w_0", "linear_0.w_0"):
        for acc in ("beta1_pow_acc", "beta2_pow_acc"):
            opt[f"{p}_fp32_master_0_{acc}_0"] = z([1], dtype="float32")
    opt["master_weights"] = {"embedding_0.w_0": z([256, h], dtype="float32"),
                             "linear_0.w_0": z([h, f], dtype="float32")}
    opt["LR_Scheduler"] = {"last_epoch": 3, "last_lr": 0.001}
    record = {"paddle": paddle.__version__, "numpy": np.__version__,
              "python": sys.version.split()[0], "command": __doc__.split("\n")[2].strip(), "files": {}}
    with tempfile.TemporaryDirectory() as d:
        for name, obj in (("model_state.pdparams", model), ("optimizer.pdopt", opt)):
            path = os.path.join(d, name)
            paddle.save(obj, path)
            with open(path, "rb") as fh:
                data = fh.read()
            record["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                                     "structure": describe(pickle.loads(data))}
    with open(OUT, "w") as fh:  # a file a line: the structures stay readable in a diff
        fh.write("{\n" + ", ".join(f'"{k}": {json.dumps(record[k])}' for k in ("paddle", "numpy", "python"))
                 + f',\n "command": {json.dumps(record["command"])},\n "files": {{\n')
        fh.write(",\n".join(f'  {json.dumps(k)}: {{"sha256": {json.dumps(v["sha256"])}, "bytes": {v["bytes"]},'
                             f'\n   "structure": {json.dumps(v["structure"])}}}' for k, v in record["files"].items()))
        fh.write("\n }\n}\n")
    print(OUT, {k: v["bytes"] for k, v in record["files"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
