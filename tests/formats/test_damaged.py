"""Damaged checkpoints of every format are diagnosed: a project error naming the file (and the
key or field), and the CLI prints one line and exits 2 without writing anything.

The cases (`tests/attacks/damage.py`) truncate files, flip bytes in zip central directories,
pickle streams, safetensors headers, DCP metadata and JSON metadata, remove or add rank files,
make shapes, dtypes, chunks and topologies disagree. Each works on a fresh copy of a small
source checkpoint written once per run (`tests/attacks/sources.py`). The regression tests at
the end pin the reader bugs these cases found.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
from attacks import damage
from attacks.sources import shared_sources

from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import close_all

CASES = damage.CASES


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    return shared_sources(tmp_path_factory)


def test_every_format_has_cases_of_each_kind():
    by_format: dict[str, set[str]] = {}
    for c in CASES:
        by_format.setdefault(c.format, set()).add(c.kind)
    assert set(by_format) == {
        "hf", "megatron", "meta-llama", "dcp", "deepspeed", "paddle", "paddle-unified", "colossal"
    }
    for fmt in ("megatron", "meta-llama", "dcp", "deepspeed", "paddle", "colossal"):  # ranked
        assert {"truncated", "missing", "shape", "dtype"} <= by_format[fmt], fmt
    kinds = {c.kind for c in CASES}
    assert {"truncated", "zip", "pickle", "header", "metadata", "json", "missing", "extra", "shape",
            "dtype", "chunks", "topology"} <= kinds


def test_sources_are_valid(sources):
    """Undamaged, every source opens and reads: the errors below are the damage's doing."""
    for c in {c.source: c for c in CASES}.values():
        damage.read_everything(sources[c.source], c.format)


def test_handwritten_dcp_is_what_torch_reads(sources):
    """The DCP sources are written here with torch's metadata classes: torch's own `dcp.load`
    reads them back exactly, and so does our reader (params and Adam moments)."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp
    from attacks.sources import _llama_ref

    from hybridckpt.formats.registry import open_source

    ref = _llama_ref(11)
    sd = {f"model.{k}": torch.empty(v.shape) for k, v in ref.params.items()}
    sd |= {f"optim.state.{k}.exp_avg_sq": torch.empty(v.shape) for k, v in ref.exp_avg_sq.items()}
    dcp.load(sd, checkpoint_id=sources["dcp"], no_dist=True)
    for k, v in ref.params.items():
        assert np.array_equal(sd[f"model.{k}"].numpy(), v), k
        assert np.array_equal(sd[f"optim.state.{k}.exp_avg_sq"].numpy(), ref.exp_avg_sq[k]), k
    for name in ("dcp", "dcp_local"):
        src = open_source(sources[name], "dcp")
        assert src.optimizer.step == ref.step
        for k, v in ref.params.items():
            hf = k.removeprefix("model.") if k != "lm_head.weight" else k
            got = src.tensors.get(k, src.tensors.get(hf))
            assert got is not None and np.array_equal(got.materialize(), v), (name, k)
            exp_avg = src.optimizer.slots["exp_avg"]
            assert np.array_equal(exp_avg[k if k in exp_avg else hf].materialize(), ref.exp_avg[k])
    close_all()


def test_handwritten_zero2_matches_its_reference(sources, tmp_path):
    import numpy as np
    from attacks.sources import write_zero2

    from hybridckpt.formats.registry import open_source

    ref = write_zero2(str(tmp_path / "again"))  # the same seed: the reference values
    src = open_source(sources["deepspeed"], "deepspeed")
    assert sorted(src.tensors) == sorted(ref) and src.optimizer.step == 3
    for n, (w, m, v) in ref.items():
        assert np.array_equal(src.tensors[n].materialize(), w), n
        assert np.array_equal(src.optimizer.slots["exp_avg"][n].materialize(), m), n
        assert np.array_equal(src.optimizer.slots["exp_avg_sq"][n].materialize(), v), n
    close_all()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_damage_is_diagnosed(sources, tmp_path, case):
    """The reader: a project error naming the file and key. The CLI: one line on stderr, exit
    2, nothing written."""
    r = damage.diagnose(case, sources, str(tmp_path))
    assert r.ok, f"{case.id}: {r.why} ({r.error}: {r.message})"
    why = damage.cli_check(case, r.path, str(tmp_path / "out"))
    assert not why, f"{case.id}: {why}"


# -- regressions: reader bugs found by the cases above and by tests/test_fuzz.py --------------


def _safetensors(path, header: bytes, data: bytes = b"\0" * 8):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return str(path)


@pytest.mark.parametrize(
    "header, match",
    [
        (b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 4]}}', "expected dtype"),
        (b'{"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}', "expected dtype"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.9]}}', "expected dtype"),
        (b'{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', "expected dtype"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
         b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "names 'a' twice"),
        (b"[" * 50_000 + b"]" * 50_000, "not valid JSON"),
        (b'{"__metadata__": {"k": {"x": 1}}}', "must be strings"),
    ],
)
def test_safetensors_header_regressions(tmp_path, header, match):
    from hybridckpt.containers.safetensors_file import read_header

    # before: OverflowError / RecursionError escaped, floats were truncated, duplicates and
    # non-string metadata were accepted
    with pytest.raises(FormatError, match=f"bad.safetensors.*{match}"):
        read_header(_safetensors(tmp_path / "bad.safetensors", header))
    close_all()


def test_hf_index_cannot_point_outside_the_folder(sources, tmp_path):
    case = next(c for c in CASES if c.name == "index names a file outside the folder")
    path = damage.prepare(case, sources, str(tmp_path))
    assert os.path.isfile(os.path.join(path, "..", "outside.safetensors"))  # it would be read
    with pytest.raises(FormatError, match=r"index\.json.*'\.\./outside\.safetensors'.*only a path inside the checkpoint folder"):
        damage.read_everything(path, "hf")


def test_namespace_pickled_before_loading_is_not_an_attack(tmp_path):
    """`copyreg` caches `__slotnames__` on argparse.Namespace the first time a process pickles
    one (e.g. `torch.save(args)`); every later Megatron load was refused as 'pickle tried to
    modify class argparse.Namespace' (and the cache deleted). A fresh interpreter, no pytest."""
    code = (
        "import argparse, pickle\n"
        "from hybridckpt.containers.pickle.machine import safe_loads\n"
        "data = pickle.dumps(argparse.Namespace(lr=0.1), protocol=2)\n"
        "assert '__slotnames__' in vars(argparse.Namespace)\n"
        "print(safe_loads(data, what='args.pkl'))\n"
        "evil = b'\\x80\\x02cargparse\\nNamespace\\nN}X\\x0d\\x00\\x00\\x00__slotnames__]X\\x01\\x00\\x00\\x00x'"
        " + b'as\\x86b.'\n"
        "try:\n    safe_loads(evil, what='evil.pkl')\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
        "print(vars(argparse.Namespace).get('__slotnames__'), pickle.loads(pickle.dumps(argparse.Namespace(a=1))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "Namespace(lr=0.1)"
    assert lines[1].startswith("UnsafePickleError evil.pkl: pickle tried to modify class argparse.Namespace")
    assert lines[2] == "None Namespace(a=1)"  # the forged entry is gone; pickling still works


def test_megatron_extra_rank_folder_is_refused(sources, tmp_path):
    case = next(c for c in CASES if c.id == "megatron:extra rank folder")
    path = damage.prepare(case, sources, str(tmp_path))
    with pytest.raises(FormatError, match=r"tp=2 pp=2 but rank folder\(s\) mp_rank_02_001 lie outside"):
        damage.read_everything(path, "megatron")


@pytest.mark.parametrize("name", ["meta-llama:dtype differs on rank 1", "deepspeed:exp_avg dtype differs on rank 1",
                                  "colossal:dtype differs on rank 1",
                                  "paddle:shape differs on tp rank 1 in model and moments"])
def test_rank_disagreements_name_the_file(sources, tmp_path, name):
    """Before: lazy.Concat's 'cannot concatenate dtypes/shapes' named no file or key."""
    case = next(c for c in CASES if c.id == name)
    r = damage.diagnose(case, sources, str(tmp_path))
    assert r.ok and "cannot concatenate" not in r.message.split(":")[0], r


@pytest.mark.parametrize(
    "item, match",
    [(dict(lengths=[12]), "offsets .* dims"), (dict(offsets=[0, 0, 0]), "offsets .* dims"),
     (dict(lengths=[-5, 16]), "negative offsets")],
)
def test_colossal_offsets_and_lengths(sources, tmp_path, item, match):
    """Before: a ValueError escaped (zip(strict=True), or a Slice of a negative length)."""
    import shutil

    path = tmp_path / "c"
    shutil.copytree(sources["colossal"], path)
    meta = path / damage.COL1
    doc = json.loads(meta.read_text())
    doc["metadata"][damage.GATE].update(item)
    meta.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=rf"meta-dist-00001\.json: 'model\.layers\.0\.mlp\.gate_proj\.weight': {match}"):
        damage.read_everything(str(path), "colossal")


@pytest.mark.parametrize(
    "meta, match",
    [
        ({"parallel_config": [2]}, "parallel_config is list"),
        ({"sharding_metas": []}, "sharding_metas is list"),
        ({"sharding_metas": {"tp00_pp00": 3}}, r"sharding_metas\['tp00_pp00'\] is int"),
        ({"sharding_metas": {"tp00_pp00": {"param_meta": {"x": {"0": 1}}}}}, r"sharding_metas\['tp00_pp00'\]\.param_meta is not"),
        ({"sharding_metas": {"tp00_pp00": {"structure_name_mapping": {"x": 1}}}}, r"sharding_metas\['tp00_pp00'\]\.structure_name_mapping"),
        ({"sharding_metas": {"tp00_pp00": {"sharding_strategy": {"a": 1}}}}, r".*sharding_strategy is not a string"),
        ({"sharding_metas": {"tp00_pp00": {"param_meta": {"llama.norm.weight": [[-8], 10]}}}}, r"bad param_meta for 'llama\.norm\.weight'"),
    ],
)
def test_paddle_model_meta_types(sources, tmp_path, meta, match):
    """Before: AttributeError / KeyError escaped from `.get` on lists and `pm[0]` on dicts."""
    import shutil

    path = tmp_path / "p"
    shutil.copytree(sources["paddle"], path)
    (path / "model_meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=f"model_meta.json: {match}"):
        damage.read_everything(str(path), "paddle")


@pytest.mark.parametrize("info", ['[1, 2]', '{"w": 3}', '{"w": {"saved_offsets": ["a"]}}',
                                  '{"w": {"saved_offsets": [-1]}}'])
def test_dcp_sharding_info_types(tmp_path, info):
    """Before: AttributeError / ValueError escaped from DCP_SHARDING_INFO of other shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    from hybridckpt.formats import dcp

    save_file({"w": np.zeros(4, np.float32)}, str(tmp_path / "shard-00000-model-00001-of-00001.safetensors"),
              metadata={"DCP_SHARDING_INFO": info})
    with pytest.raises(FormatError, match=r"shard-00000-model-00001-of-00001\.safetensors"):
        dcp.read_hf_shards(str(tmp_path), [str(tmp_path / "shard-00000-model-00001-of-00001.safetensors")])
    close_all()


def test_corrupt_zip_offsets_and_versions(tmp_path):
    """Before: OSError (pread at a negative offset) and NotImplementedError ("zip file version
    22.9") escaped from torch_save.load."""
    import torch

    from hybridckpt.containers.pickle import torch_save

    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    data = good.read_bytes()
    rec = damage._cd_record(data, "/data/0")
    neg = bytearray(data)
    end64 = data.rfind(b"PK\x06\x06")
    struct.pack_into("<Q", neg, end64 + 48, struct.unpack_from("<Q", data, end64 + 48)[0] + 1)  # shifts offsets by -1
    struct.pack_into("<I", neg, damage._cd_record(data, "/byteorder") + 42, 0)  # the first entry read
    version = bytearray(data)
    version[rec + 6] = 229  # version needed to extract: 22.9
    cases = (("neg.pt", neg, "neg.pt: entry .* local header offset -1 lies before the archive"),
             ("version.pt", version, "version.pt: not a readable zip"))
    for name, blob, match in cases:
        (tmp_path / name).write_bytes(bytes(blob))
        with pytest.raises(FormatError, match=match):
            torch_save.load(tmp_path / name)
        close_all()


def test_byte_source_refuses_negative_offsets(tmp_path):
    from hybridckpt.io.byte_source import ByteSource

    (tmp_path / "f.bin").write_bytes(b"abcdef")
    with pytest.raises(FormatError, match=r"f\.bin: read at byte -1, before the start"):
        ByteSource(str(tmp_path / "f.bin")).read(-1, 2)
    close_all()
