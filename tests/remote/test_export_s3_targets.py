"""Every `--to` written to a bucket equals the same export to a local folder, byte for byte (the
commit marker aside; what a save records of its own moment aside: the random save id torch DCP
pickles into `.metadata`, Orbax's timestamps in `_CHECKPOINT_METADATA` and the folder it committed
in `commit_success.txt`): DCP, Megatron torch_dist, a Paddle unified checkpoint, MaxText's train
state. Against a moto server on 127.0.0.1.
"""

from __future__ import annotations

import json

import pytest
from test_export_s3 import client, download, local_files

import hybridckpt
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import close_all
from hybridckpt.writers import ownership

TIMESTAMPED = {"_CHECKPOINT_METADATA"}  # Orbax: {"init_timestamp_nsecs", "commit_timestamp_nsecs", ...}


def same(name: str, got: bytes, want: bytes) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base in TIMESTAMPED:
        return json.loads(got).keys() == json.loads(want).keys()
    if base == "commit_success.txt":  # "Checkpoint commit was successful to <the folder it wrote>"
        return got.rsplit(b" ", 1)[0] == want.rsplit(b" ", 1)[0]
    if base == ".metadata":  # DCP's StorageMeta: the folder it was written in, a uuid4 of each save
        import pickle

        import torch.distributed.checkpoint  # noqa: F401  (test-only: the classes the pickle names)

        a, b = pickle.loads(got), pickle.loads(want)
        return (a.state_dict_metadata == b.state_dict_metadata and a.storage_data == b.storage_data
                and a.planner_data == b.planner_data and a.version == b.version)
    return got == want


@pytest.mark.parametrize("to", ["dcp", "megatron", "paddleformers-unified", "maxtext"])
def test_export_to_s3_equals_the_local_export(s3, tmp_path, to):
    fs = client(s3)
    bucket = f"t-{to}"
    fs.mkdir(bucket)
    hybridckpt.export_checkpoint(sample_path(), str(tmp_path / to), to=to, optimizer=to != "maxtext")
    summary = hybridckpt.export_checkpoint(sample_path(), f"s3://{bucket}/out", to=to, optimizer=to != "maxtext")
    close_all()
    assert summary.destination == f"s3://{bucket}/out"
    got, want = download(fs, f"{bucket}/out"), local_files(tmp_path / to)
    marker = json.loads(got.pop(ownership.MARKER))
    want.pop(ownership.MARKER)
    assert got.keys() == want.keys() and len(want) >= 2
    assert marker["files"] == sorted(want)
    assert sum(name.endswith((".distcp", ".safetensors", "/0", ".0")) for name in want) >= 1  # the tensors' bytes
    for name in want:
        assert same(name, got[name], want[name]), name
