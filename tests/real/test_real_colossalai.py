"""ColossalAI distributed checkpoints written by ColossalAI itself (`generators/colossalai.py`:
HybridParallelPlugin tp 2 on gloo CPU ranks, `booster.save_model(..., gather_dtensor=False)` of PR
hpcaitech/ColossalAI#6181, sharded .bin, sharded safetensors and unsharded).

Params: bit for bit against the same model saved by ColossalAI's released gathered path, from the
reader and after import on a mesh, restore on another and export. Logits: our forward against
the plugin's forward on 2 tp ranks, fp32, max abs gap 1e-5 (logits of order one). The dist save
writes no config.json: the model's config (`hf_config.json` beside the case's ckpt/) is passed.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from cases import case_dir, ckpt, manifest, reference
from roundtrip_real import bitwise_equal, import_export, mesh_pair

from hybridckpt import jobs
from hybridckpt.errors import FormatError
from hybridckpt.formats import colossal
from hybridckpt.formats.registry import detect

CASES = ["colossal_tp2_sharded_bin", "colossal_tp2_sharded_safetensors", "colossal_tp2_unsharded"]
LOGITS_ATOL = 1e-5


def _config(case: str) -> str:
    return os.path.join(case_dir(case), "hf_config.json")


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_model_bit_for_bit(case):
    from hybridckpt import models

    path = ckpt(case)
    assert detect(path) == "colossal" and not os.path.exists(os.path.join(path, "config.json"))
    cfg = models.config_from_hf(json.load(open(_config(case))))
    src = colossal.open(path, config=cfg)
    assert src.topology == {"model_parallel_ranks": 2}
    want = _weights(reference(case))
    assert sorted(src.tensors) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(src.tensors[k].materialize(), v), k


def test_what_the_tool_wrote():
    """The layout facts the reader's docstring states, pinned on the real files."""
    names = {c: sorted(os.listdir(ckpt(c))) for c in CASES}
    assert "pytorch_model-meta-dist-00000.json" in names["colossal_tp2_sharded_bin"]  # .bin: `.json`
    assert "pytorch_model-meta-dist-00000.index.json" in names["colossal_tp2_sharded_safetensors"]
    assert "pytorch_model-dist-00000-shard-00000.bin" in names["colossal_tp2_sharded_bin"]  # from 0
    meta = json.load(open(os.path.join(ckpt("colossal_tp2_unsharded"), "pytorch_model-meta-dist-00001.json")))
    entry = meta["metadata"]["model.embed_tokens.weight"]
    assert entry["file"] == "ckpt/pytorch_model-dist-00001.bin"  # the path save_model was given
    assert (entry["offsets"], entry["lengths"], entry["global_shape"]) == ([64, 0], [64, 32], [128, 32])
    assert meta["total_size"] is None
    probe = next(n for n in manifest("colossal_tp2_sharded_bin")["notes"] if n.startswith("padded-vocab"))
    assert "isn't evenly distributed" in probe  # a padded vocab cannot be saved this way


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_colossalais_forward(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=mesh_pair()[0], config=_config(case))
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", ["colossal_tp2_sharded_safetensors", "colossal_tp2_unsharded"])
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False, config=_config(case))
    want = _weights(reference(case))
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


def test_rank_files_matter(tmp_path):
    """Negative control: rank 1's metadata pointing at rank 0's weights gives other params."""
    case = "colossal_tp2_sharded_bin"
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt(case), copy)
    meta = copy / "pytorch_model-meta-dist-00001.json"
    doc = json.loads(meta.read_text())
    for item in doc["metadata"].values():
        item["file"] = item["file"].replace("-dist-00001-", "-dist-00000-")
    meta.write_text(json.dumps(doc))
    src = colossal.open(str(copy), config=None)
    want = _weights(reference(case))
    assert not bitwise_equal(src.tensors["lm_head.weight"].materialize(), want["lm_head.weight"])


def test_unsharded_path_stays_in_the_folder(tmp_path):
    """The unsharded metadata's path is reduced to its name inside the folder: a path naming a
    file elsewhere reads nothing outside (a missing name is an error naming the entry)."""
    case = "colossal_tp2_unsharded"
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt(case), copy)
    meta = copy / "pytorch_model-meta-dist-00000.json"
    doc = json.loads(meta.read_text())
    doc["metadata"]["model.norm.weight"]["file"] = "../../etc/passwd"
    meta.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"weight file '\.\./\.\./etc/passwd' is missing"):
        colossal.open(str(copy))
