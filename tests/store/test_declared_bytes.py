"""An Orbax item whose metadata declares far more bytes than its files hold is refused when it is
opened, before a plan, an allocation or a write (issue 38, `containers.orbax.declared`).

Each hostile checkpoint is a real one edited as an attacker would: our own import (raw chunks,
the default, and zstd-compressed), and MaxText's own save (`tests/real/cases/maxtext_llama3`,
zstd chunks in a folder per array), with one leaf's `.zarray` (or the OCDBT index's copy of it)
declaring 2^20 x 2^20 elements (4 TiB of float32) while its chunk files hold a few hundred bytes.
Through the CLI: one line naming the leaf, the bytes declared and the bytes present, exit 2,
a few KB read (`count_reads`), nothing written beside the destination.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import numpy as np
import pytest
from attacks.hostile import unknown_arch_folder
from test_hostile import cli, one_line

import hybridckpt
from hybridckpt.formats import orbax_store as as_source
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import tally

HUGE = [1 << 20, 1 << 20]
HUGE_BYTES = 4 << 40
REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
TENSORS = {"w": np.arange(64, dtype=np.float32).reshape(8, 8), "up": np.arange(64, dtype=np.float32) * -2}


@pytest.fixture(scope="module", params=["none", "zstd"])
def store(request, tmp_path_factory):
    """A model-agnostic import of `TENSORS` with `--compression` none (raw chunk files) or zstd."""
    root = tmp_path_factory.mktemp(f"declared-{request.param}")
    unknown_arch_folder(str(root / "src"), TENSORS)
    hybridckpt.import_checkpoint(str(root / "src"), str(root / "ck"), compression=request.param)
    return str(root / "ck"), request.param


def _declare(path: str, shape) -> None:
    """Rewrite the `.zarray` at `path` with `shape` (chunks kept)."""
    with open(path) as f:
        spec = json.load(f)
    spec["shape"] = list(shape)
    os.remove(path)  # (written read-only by some savers)
    with open(path, "w") as f:
        json.dump(spec, f)


def _declare_ocdbt(item: str, leaf: str, shape) -> None:
    """Rewrite the `.zarray` of `leaf` kept inline in the OCDBT index of `item` (a new version of
    the database, written by TensorStore itself) with `shape`."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(item)}/"}).result()
    spec = json.loads(kv.read(f"{leaf}/.zarray").result().value)
    spec["shape"] = list(shape)
    kv.write(f"{leaf}/.zarray", json.dumps(spec).encode()).result()


def _refused_everywhere(capsys, tmp_path, src: str, *must: str, extra=()) -> None:
    """`inspect`, `import --plan`, `import` and (for our store) `export`: one line, exit 2, a few
    KB read, nothing written beside the destination."""
    before = sorted(os.listdir(tmp_path))
    for args in (["inspect", src], ["import", src, tmp_path / "dst", "--plan"], ["import", src, tmp_path / "dst"],
                 ["export", src, tmp_path / "out"]):
        if args[0] == "export" and "maxtext" in src:
            continue
        with count_reads() as reads:
            code, _, err = cli(capsys, *args, *extra)
        one_line(code, err, *must)
        assert tally(reads)[0] < 256 << 10, (args, tally(reads))
        assert sorted(os.listdir(tmp_path)) == before, args


def test_a_store_leaf_declaring_4_tib_is_refused_before_planning(store, tmp_path, capsys):
    path, codec = store
    copy = str(tmp_path / "ck")
    shutil.copytree(path, copy)
    params = glob.glob(os.path.join(copy, "*", "params"))[0]
    if codec == "none":  # a raw leaf (a file per chunk): its chunks must hold every declared byte
        _declare(os.path.join(params, "w", ".zarray"), HUGE)
        must = ["leaf 'w'", f"declares {HUGE_BYTES} bytes", "its chunks hold 256 bytes"]
    else:  # compressed, in one OCDBT database: refused past 1000 x the item's bytes
        _declare_ocdbt(params, "w", HUGE)
        must = ["leaf 'w'", f"{HUGE_BYTES} bytes declared", "bytes present"]
    _refused_everywhere(capsys, tmp_path, copy, *must)
    code, _, err = cli(capsys, "export", copy, tmp_path / "out", "--no-verify-reads")
    one_line(code, err, *must)
    assert not os.path.exists(tmp_path / "out")
    with count_reads() as reads:  # verify (a store alone: its CRC tables) stops at the item too
        code, _, err = cli(capsys, "verify", copy)
    one_line(code, err, *must)
    assert tally(reads)[0] < 256 << 10


def test_a_raw_leaf_missing_its_chunk_is_refused(tmp_path):
    """A raw leaf whose chunk file is deleted: read as zeros (the fill value) before; now refused."""
    src = str(tmp_path / "src")
    unknown_arch_folder(src, {"w": np.arange(1 << 16, dtype=np.float32).reshape(256, 256)})
    ck = str(tmp_path / "ck")
    hybridckpt.import_checkpoint(src, ck)
    params = glob.glob(os.path.join(ck, "*", "params"))[0]
    chunks = sorted(glob.glob(os.path.join(params, "w", "[0-9]*")))
    assert chunks and sum(os.path.getsize(c) for c in chunks) == 1 << 18
    os.remove(chunks[0])
    have = sum(os.path.getsize(c) for c in chunks[1:])
    with pytest.raises(hybridckpt.errors.CheckpointError, match=f"leaf 'w' .*declares {1 << 18} bytes.*its chunks hold {have} bytes"):
        as_source.open(ck, verify_reads=False)


def test_stores_within_their_bytes_still_read(store, tmp_path):
    """The control: as imported (raw or zstd), every leaf reads back its values."""
    path, _ = store
    got = as_source.open(path).tensors
    for k, v in TENSORS.items():
        assert np.array_equal(got[k].materialize(), v)


def test_a_maxtext_leaf_declaring_4_tib_is_refused_before_planning(tmp_path, capsys):
    case = os.path.join(REAL, "maxtext_llama3", "ckpt")
    copy = str(tmp_path / "mt")
    shutil.copytree(case, copy)
    items = glob.glob(os.path.join(copy, "*", "items"))[0]
    leaf = "params.params.decoder.decoder_norm.scale"
    _declare(os.path.join(items, leaf, ".zarray"), [1 << 40])
    config = os.path.join(REAL, "torchtitan_llama3", "config.json")
    _refused_everywhere(capsys, tmp_path, copy, f"leaf {leaf!r}", f"{HUGE_BYTES} bytes declared",
                        "bytes present", extra=["--config", config])


@pytest.mark.parametrize("case", ["maxtext_llama3", "maxtext_mistral", "maxtext_qwen3", "maxtext_qwen3_moe"])
def test_real_maxtext_checkpoints_still_open(case):
    from hybridckpt.containers.orbax.reader import item_arrays

    items = glob.glob(os.path.join(REAL, case, "ckpt", "*", "items"))[0]
    arrays = item_arrays(items)  # (every leaf's values are checked by tests/real/test_real_maxtext_layout.py)
    scale = arrays["params.params.decoder.decoder_norm.scale"].materialize()
    assert scale.shape == arrays["params.params.decoder.decoder_norm.scale"].shape and np.isfinite(scale).all()
    assert scale.any()


def test_a_restore_by_orbax_refuses_before_allocating(store, tmp_path):
    """`hybridckpt.restore(..., verify_reads=False)` hands the item to Orbax, which allocates every
    array it declares: a leaf declaring 1.5 GiB over a few KB (past the 1 GiB floor) is refused
    first, naming it (before, 1.5 GiB of fill value was restored)."""
    path, codec = store
    copy = str(tmp_path / "ck")
    shutil.copytree(path, copy)
    params = glob.glob(os.path.join(copy, "*", "params"))[0]
    shape = [3 << 13, 1 << 14]
    if codec == "none":
        _declare(os.path.join(params, "w", ".zarray"), shape)
    else:
        _declare_ocdbt(params, "w", shape)
    with pytest.raises(hybridckpt.errors.CheckpointError, match=re.escape(f"leaf 'w', float32 {shape}: {3 << 29} bytes declared, ") + r"\d+ bytes stored for it"):
        hybridckpt.restore(copy, "dp=1", verify_reads=False)


def test_the_item_bound_is_zstds_most():
    """An item may declare up to 32768 x its files' bytes (what zstd reaches on zeros: a 128 KiB
    block in 4 bytes), past 1 GiB; one byte more is refused. No file is read, only sized."""
    import tempfile
    from types import SimpleNamespace

    from hybridckpt.containers.orbax.declared import GENEROUS_RATIO, check_item

    with tempfile.TemporaryDirectory() as item:
        os.makedirs(os.path.join(item, "mu"))
        present = 1 << 16  # 64 KiB of chunk files -> 2 GiB allowed
        with open(os.path.join(item, "mu", "0.0"), "wb") as f:
            f.truncate(present)
        fits = {"mu": SimpleNamespace(shape=(GENEROUS_RATIO * present // 4,), dtype=np.dtype(np.float32))}
        check_item(item, fits, None, False)
        over = {"mu": SimpleNamespace(shape=(GENEROUS_RATIO * present // 4 + 1,), dtype=np.dtype(np.float32))}
        with count_reads() as reads, pytest.raises(hybridckpt.errors.CheckpointError,
                                                   match=f"declare {GENEROUS_RATIO * present + 4} bytes but its files hold {present} bytes"):
            check_item(item, over, None, False)
        assert tally(reads)[0] == 0
