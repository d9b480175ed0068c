"""The Paddle scale source (`benchmarks/scale_paddle.py`, PaddleNLP hybrid per-rank folders with
the arrays as holes) has the structure of the test writer's hybrid checkpoints
(`tests/fixtures/paddle_writer.py`, whose files unpickle as paddle 3.3.1's do: same files, keys
in the same order, the same `param.name`s, shapes, dtypes and pickled forms; only the values
differ), and `hybridckpt inspect` reads it with the sizes it states.
"""

import io
import os
import sys
from contextlib import redirect_stdout

import numpy as np
from fixtures import paddle_writer as pw

from hybridckpt.cli import main
from hybridckpt.containers.pickle import paddle_save
from hybridckpt.lazy import LazyTensor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_paddle as sp  # noqa: E402

SMALL = {"hidden": 32, "ffn": 48, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 64}


def _shape_of(x, path):
    """The structure of a loaded paddle.save object: values replaced by (shape, dtype)."""
    if isinstance(x, (np.ndarray, LazyTensor)):
        return ("array", tuple(x.shape), np.dtype(x.dtype).str)
    if isinstance(x, tuple):
        return tuple(_shape_of(v, path) for v in x)
    if isinstance(x, dict):
        return [(k, _shape_of(v, path)) for k, v in x.items() if k != "LR_Scheduler"]
    return type(x).__name__


def _structure(folder):
    return {f: _shape_of(paddle_save.safe_load(os.path.join(folder, f)), f)
            for f in sorted(os.listdir(folder)) if f.endswith((".pdparams", ".pdopt"))}


def test_structure_is_the_test_writers(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    sp.write_hybrid(str(ours), 2, 2, 2, c=SMALL, step=3, log=lambda s: None)
    ref = pw.reference_llama(step=3)
    pw.write_hybrid(str(theirs), ref, pw.Options(tp=2, pp=2, sharding=2, strategy="stage1", bf16=True))
    a, b = _structure(str(ours)), _structure(str(theirs))
    assert sorted(a) == sorted(b) and len(a) == 4 + 8
    for f in a:
        assert a[f] == b[f], f


def test_inspect_reads_the_sizes_it_states(tmp_path):
    info = sp.write_hybrid(str(tmp_path), 2, 2, 2, c=SMALL, step=3, log=lambda s: None)
    assert info["ranks"] == 8 and info["files"] == 4 + 8
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["inspect", str(tmp_path)]) == 0
    text = out.getvalue()
    assert '"tp": 2' in text and '"pp": 2' in text and '"sharding": 2' in text
    assert '"step": 3' in text and '"master_weights": 21' in text
    assert "llama.layers.1.mlp.down_proj.weight" in text and "(48, 32)" in text
