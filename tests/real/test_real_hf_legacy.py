"""Legacy HF torch shards written by transformers 4.57's `save_pretrained(safe_serialization=False)`
(`generators/hf_legacy.py`): a tied Qwen2 in one `pytorch_model.bin`, an untied Llama in three
`pytorch_model-0000i-of-00003.bin` with their index, and the same without the index.

Params bit for bit from the reader and after import on a mesh, restore on another and export;
logits against transformers' own forward (fp32, max abs gap 1e-5).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from cases import ckpt, reference
from roundtrip_real import bitwise_equal, import_export, mesh_pair

from hybridckpt import jobs
from hybridckpt.errors import FormatError
from hybridckpt.formats.registry import detect, open_source

CASES = ["hf_bin_qwen2_tied", "hf_bin_llama_sharded"]
LOGITS_ATOL = 1e-5


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


def _without_index(tmp_path) -> str:
    copy = tmp_path / "noindex"
    shutil.copytree(ckpt("hf_bin_llama_sharded"), copy)
    os.remove(copy / "pytorch_model.bin.index.json")
    return str(copy)


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_tensors_bit_for_bit(case):
    path = ckpt(case)
    assert detect(path) == "hf"
    src = open_source(path)
    want = _weights(reference(case))
    for k, v in want.items():
        assert bitwise_equal(src.tensors[k].materialize(), v), k
    extra = set(src.tensors) - set(want)
    assert extra == ({"lm_head.weight"} if case == "hf_bin_qwen2_tied" else set())


def test_tied_head_is_the_embeddings_storage():
    """transformers 4.57 pickles the tied head as a view of the embedding's storage: the reader sees
    one storage under two names (read once: the family's rules drop the copy)."""
    src = open_source(ckpt("hf_bin_qwen2_tied"))
    assert any("lm_head.weight is a view of model.embed_tokens.weight" in n for n in src.notes)
    assert not any("view of" in n for n in open_source(ckpt("hf_bin_llama_sharded")).notes)


def test_inspect_says_which_files(tmp_path):
    one = jobs.inspect(ckpt("hf_bin_qwen2_tied"))
    assert "legacy torch weights: pytorch_model.bin" in one["notes"]
    indexed = jobs.inspect(ckpt("hf_bin_llama_sharded"))
    assert "legacy torch weights: 3 torch shard(s) by pytorch_model.bin.index.json" in indexed["notes"]
    bare = jobs.inspect(_without_index(tmp_path))
    assert "legacy torch weights: 3 torch shard(s) by their names (no pytorch_model.bin.index.json)" in bare["notes"]
    assert sorted(t["name"] for t in bare["tensors"]) == sorted(t["name"] for t in indexed["tensors"])


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise(case, tmp_path):
    params, _, _, _ = import_export(ckpt(case), tmp_path, optimizer=False)
    want = _weights(reference(case))
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


def test_shards_without_index_import_bitwise(tmp_path):
    params, _, _, _ = import_export(_without_index(tmp_path), tmp_path / "work", optimizer=False)
    for k, v in _weights(reference("hf_bin_llama_sharded")).items():
        assert bitwise_equal(params[k], v), k


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=mesh_pair()[0])
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


def test_a_missing_shard_is_named(tmp_path):
    copy = _without_index(tmp_path)
    os.remove(os.path.join(copy, "pytorch_model-00002-of-00003.bin"))
    with pytest.raises(FormatError, match="missing.*pytorch_model-00002-of-00003.bin"):
        open_source(copy)


def test_a_shard_the_index_does_not_name_for_a_tensor_is_refused(tmp_path):
    import json

    copy = tmp_path / "moved"
    shutil.copytree(ckpt("hf_bin_llama_sharded"), copy)
    idx = json.loads((copy / "pytorch_model.bin.index.json").read_text())
    files = list(idx["weight_map"].values())
    name = next(n for n, f in idx["weight_map"].items() if files.count(f) > 1)  # its file still read
    others = sorted(set(idx["weight_map"].values()) - {idx["weight_map"][name]})
    idx["weight_map"][name] = others[0]
    (copy / "pytorch_model.bin.index.json").write_text(json.dumps(idx))
    with pytest.raises(FormatError, match="which pytorch_model.bin.index.json puts in"):
        open_source(str(copy))
