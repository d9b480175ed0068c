"""Declared shapes checked against the bytes present before a plan (issue 38), for the formats
whose readers build tensors from metadata and parse the data files only on a first read.

- FlexCheckpoint: a `0.metadata` (our fixture writer's, in Paddle's pickled classes) declaring
  one block of 2^20 x 2^20 float32 (4 TiB) in a `.distcp` file of a few KB is refused in one
  line naming the file, the block, the bytes declared and present, by `inspect`,
  `import --plan` and `import`, with a few KB read and nothing written (before, the plan was
  made from the metadata alone and the import began).
- paddle.save big parameters (`UnpackBigParamInfor@@`): an `OriginShape` whose element count
  wraps int64 to the parts' total was accepted as a 2^62-row tensor; now compared exactly.
(torch.save zips and legacy files, safetensors, Paddle's numpy payloads, DCP and our own store
are covered where their readers' checks are tested: `tests/test_bounded.py`,
`tests/store/test_declared_bytes.py`, `tests/formats/test_damaged.py`.)
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from fixtures import flex_writer as fw
from fixtures import paddle_writer as pw
from test_hostile import cli, one_line

from hybridckpt.errors import FormatError
from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.io.read_tally import tally

HUGE = (1 << 20, 1 << 20)


def _declare_huge(md) -> str:
    """Make the first plain block of a one-block tensor declare `HUGE` (tensor and block)."""
    for lti, fname in list(md.storage_metadata.items()):
        metas = md.state_dict_metadata[lti.tensor_key]
        if not lti.is_flattened and len(metas) == 1 and len(metas[0].local_shape) == 2:
            metas[0] = replace(metas[0], local_shape=HUGE, global_shape=HUGE)
            del md.storage_metadata[lti]
            md.storage_metadata[replace(lti, local_shape=HUGE)] = fname
            return lti.tensor_key
    raise AssertionError("no one-block 2-D tensor")


@pytest.mark.parametrize("args", [["inspect"], ["import", "--plan"], ["import"]])
def test_flex_metadata_declaring_4_tib_is_refused_before_planning(tmp_path, capsys, args):
    ckpt, _ = fw.write_output_folder(str(tmp_path / "src"), pw.reference_llama(0), fw.Options())
    folder = os.path.join(ckpt, "model_state")
    holder = {}
    fw.edit_metadata(folder, lambda md: holder.setdefault("key", _declare_huge(md)))
    dst = str(tmp_path / "dst")
    cmd = [args[0], ckpt, *([dst] if args[0] == "import" else []), *args[1:]]
    before = sorted(os.listdir(tmp_path))
    with count_reads() as reads:
        code, _, err = cli(capsys, *cmd)
    one_line(code, err, f"{holder['key']!r}", f"{4 << 40} bytes", "float32 [1048576, 1048576]", ".distcp", "bytes);")
    assert "file of" in err and "refused before planning" in err
    assert tally(reads)[0] < 256 << 10, tally(reads)
    assert sorted(os.listdir(tmp_path)) == before
    close_all()


def test_big_param_origin_shape_that_wraps_int64_is_refused(tmp_path):
    """Parts of 4 elements and an `OriginShape` of (2^62 + 1) x 4 elements (2^64 + 4: 4 in
    int64) were reshaped into a 2^62-row tensor; the exact count refuses it."""
    from hybridckpt.containers.pickle import paddle_save

    path = str(tmp_path / "model_state.pdparams")
    shape = [(1 << 62) + 1, 4]
    pw.save_state_dict({"w@@.0": np.arange(4, dtype=np.float32),
                        "UnpackBigParamInfor@@": {"w": {"OriginShape": shape, "slices": ["w@@.0"]}}}, path)
    with pytest.raises(FormatError, match=r"parts hold 4 elements, OriginShape .* needs 18446744073709551620"):
        paddle_save.read(path)
    close_all()


# -- the readers that size tensors from the bytes themselves: guards, each a 4 TiB declaration --


def _torch_zip_size(d: str) -> tuple[str, str]:
    from attacks import opcodes as op
    from attacks.containers import Ctx, torch_zip

    c, p = Ctx("x"), os.path.join(d, "zip_view.pt")
    torch_zip(p, op.stream(op.dct({"w": c.tensor(size=HUGE, stride=(HUGE[1], 1))})))
    return p, "reaches element 1099511627775 but the storage has 4"


def _torch_zip_numel(d: str) -> tuple[str, str]:
    from attacks import opcodes as op
    from attacks.containers import Ctx, torch_zip

    c, p = Ctx("x"), os.path.join(d, "zip_numel.pt")
    torch_zip(p, op.stream(op.dct({"w": c.tensor(c.storage(numel=1 << 40), size=HUGE, stride=(HUGE[1], 1))})))
    return p, f"claims {4 << 40} bytes, entry holds 16"


def _torch_legacy(d: str) -> tuple[str, str]:
    from attacks import opcodes as op
    from attacks.containers import Ctx, torch_legacy

    c, p = Ctx("x", legacy=True), os.path.join(d, "legacy.pt")
    torch_legacy(p, op.stream(op.dct({"w": c.tensor(size=HUGE, stride=(HUGE[1], 1))})))
    return p, "reaches element 1099511627775 but the storage has 4"


def _safetensors(d: str) -> tuple[str, str]:
    import json
    import struct

    os.makedirs(os.path.join(d, "st"))
    p = os.path.join(d, "st", "model.safetensors")
    blob = json.dumps({"w": {"dtype": "F32", "shape": list(HUGE), "data_offsets": [0, 16]}}).encode()
    blob += b" " * (-len(blob) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * 16)
    return p, f"({4 << 40} bytes) inside a buffer of 16 bytes"


def _deepspeed_param_shapes(d: str) -> tuple[str, str]:
    import shutil

    import torch

    src = os.path.join(d, "ds")
    shutil.copytree(os.path.join(REAL, "hf_trainer_deepspeed_zero2", "ckpt"), src)
    p = os.path.join(src, "checkpoint-3", "global_step3", "mp_rank_00_model_states.pt")
    sd = torch.load(p, weights_only=False)  # (the real tool's file, trusted here)
    group = sd["param_shapes"][0]
    group[next(iter(group))] = torch.Size(HUGE)
    torch.save(sd, p)
    return src, "numel totals do not add up"


REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
GUARDS = {"torch-zip-view": _torch_zip_size, "torch-zip-storage": _torch_zip_numel, "torch-legacy": _torch_legacy,
          "safetensors": _safetensors, "deepspeed-param-shapes": _deepspeed_param_shapes}


@pytest.mark.parametrize("kind", list(GUARDS))
def test_declared_4_tib_is_refused_at_open(tmp_path, capsys, kind):
    src, must = GUARDS[kind](str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    for cmd in (["inspect", src], ["import", src, tmp_path / "dst", "--plan"]):
        with count_reads() as reads:
            code, _, err = cli(capsys, *cmd)
        one_line(code, err, must)
        assert tally(reads)[0] < 256 << 10, tally(reads)
        assert sorted(os.listdir(tmp_path)) == before
