"""ColossalAI distributed checkpoints: pieces at offsets assembled into global tensors.

Fixtures come from tests/fixtures/colossal_writer.py (torch.save / safetensors shards and the
per-rank metadata of PR hpcaitech/ColossalAI#6181, laid out as the files ColossalAI itself
writes: tests/real/test_real_colossalai.py reads those). Every tensor is compared bit for bit
with the reference.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from fixtures import colossal_writer as cw
from fixtures import paddle_writer as pw

from hybridckpt import naming
from hybridckpt.errors import FormatError
from hybridckpt.formats import colossal
from hybridckpt.formats import registry as readers
from hybridckpt.io.byte_source import count_reads

LAYERS = 2


@pytest.fixture(scope="module")
def ref():
    return pw.reference_llama(5, vocab=64)  # split evenly: the tool refuses a padded vocab


def _write(path, ref, **kw):
    cw.write_colossal(str(path), ref.params, layers=LAYERS, **kw)
    (path / "config.json").write_text(json.dumps(ref.config))
    return str(path)


def _meta(path, dist_id=0):
    for name in (
        f"pytorch_model-meta-dist-{dist_id:05d}.index.json",
        f"pytorch_model-meta-dist-{dist_id:05d}.json",
    ):
        if (path / name).exists():
            return path / name
    raise FileNotFoundError(dist_id)


@pytest.mark.parametrize(
    "kw",
    [
        dict(tp=2),
        dict(tp=2, pp=2, safetensors=True),
        dict(tp=4, sharded=False),
        dict(tp=1, pp=2),
        dict(tp=2, dtype=torch.bfloat16),
    ],
    ids=["tp2_bin", "tp2_pp2_safetensors", "tp4_unsharded", "pp2", "tp2_bf16"],
)
def test_import_bitwise(tmp_path, ref, kw):
    path = _write(tmp_path, ref, **kw)
    assert readers.detect(path) == "colossal"
    tp = kw.get("tp", 2)
    if tp > 1:  # the last rank's piece of the vocab starts at its partition
        meta = json.loads(_meta(tmp_path, tp - 1).read_text())["metadata"][
            "model.embed_tokens.weight"
        ]
        assert meta["lengths"][0] == 64 // tp and meta["offsets"][0] == (64 // tp) * (tp - 1)
    src = colossal.open(path)
    bf16 = kw.get("dtype") == torch.bfloat16
    want = {k: v.astype(ml_dtypes.bfloat16) if bf16 else v for k, v in ref.params.items()}
    assert set(src.tensors) == set(want)
    for k, v in want.items():
        got = src.tensors[k].materialize()
        assert got.dtype == v.dtype and got.shape == v.shape
        assert np.array_equal(got.view(np.uint8), v.view(np.uint8)), k
    assert src.hf_rules == "" and src.config.vocab_size == 64
    named = naming.hf_to_tree(naming.source_to_hf(src, src.config), src.config)
    assert named.params["embed.embedding"].shape == (64, 32)


def test_reads_only_the_box(tmp_path, ref):
    path = _write(tmp_path, ref, tp=2, safetensors=True)
    t = colossal.open(path).tensors["model.embed_tokens.weight"]  # rows 32..63 live on rank 1
    with count_reads() as c:
        got = t.read((slice(40, 42), slice(None)))
    assert np.array_equal(got, ref.params["model.embed_tokens.weight"][40:42])
    files = {k for k in c if not isinstance(k, tuple)}
    assert len(files) == 1 and "-dist-00001-" in next(iter(files))
    assert sum(c[f] for f in files) == 2 * 32 * 4


def _edit(meta_path, name, fn):
    doc = json.loads(meta_path.read_text())
    fn(doc["metadata"][name])
    meta_path.write_text(json.dumps(doc))


def test_missing_weight_file(tmp_path, ref):
    path = _write(tmp_path, ref, tp=2)
    os.remove(tmp_path / "pytorch_model-dist-00001-shard-00001.bin")
    with pytest.raises(FormatError, match=r"pytorch_model-dist-00001-shard-00001\.bin"):
        colossal.open(path)


def test_gap_overlap_and_outside(tmp_path, ref):
    name = "model.layers.0.mlp.gate_proj.weight"  # split on dim 0: rows 0..24 on rank 0, 24..48 on rank 1
    cases = [
        (0, lambda m: m.__setitem__("lengths", [22, 32]), r"gap on dim 0 at 22\.\.24"),
        (1, lambda m: m.__setitem__("offsets", [20, 0]), r"overlap on dim 0 at 20\.\.24"),
        (
            1,
            lambda m: m.__setitem__("offsets", [30, 0]),
            r"offsets \[30, 0\].*outside global_shape",
        ),
        (1, lambda m: m.__setitem__("lengths", [20, 32]), r"pieces end at 44 on dim 0"),
        (
            1,
            lambda m: m.__setitem__("global_shape", [49, 32]),
            r"global_shape \[49, 32\] disagrees",
        ),
    ]
    for i, (dist_id, fn, pattern) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        path = _write(d, ref, tp=2)
        _edit(_meta(d, dist_id), name, fn)
        with pytest.raises(FormatError, match=pattern) as e:
            colossal.open(path)
        assert name in str(e.value)


def test_name_missing_from_weight_file(tmp_path, ref):
    path = _write(tmp_path, ref, tp=2)
    meta = _meta(tmp_path, 0)
    doc = json.loads(meta.read_text())
    doc["metadata"]["model.ghost.weight"] = dict(doc["metadata"]["model.norm.weight"])
    meta.write_text(json.dumps(doc))
    with pytest.raises(
        FormatError, match=r"pytorch_model-dist-00000-shard-\d+\.bin.*model\.ghost\.weight"
    ):
        colossal.open(path)


def test_import_restore_export_bitwise(tmp_path, ref):
    from e2e import assert_same, roundtrip

    path = _write(tmp_path / "colossal", ref, tp=2, pp=2)
    # mesh A shards over fsdp and pp, mesh B over dp and fsdp
    params, _, _, _ = roundtrip(path, str(tmp_path), mesh_a="fsdp=2,pp=2", mesh_b="dp=2,fsdp=4", optimizer=False)
    assert_same(params, ref.params)
