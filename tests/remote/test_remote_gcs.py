"""Sources in a GCS bucket (issue 43): the same local view and ranged reads as S3's, through
gcsfs, against a GCS emulator started by the fixture (`fixtures.gcs_server`).

An HF sharded folder written by transformers and a DCP written by torch FSDP2, imported from
`gs://`, equal the same imports from disk bit for bit; the bytes asked of the server are bounded
by the bytes the devices needed; an export to `gs://` equals the local export file for file.
"""

from __future__ import annotations

import os

import pytest
from fixtures import remote_sources
from meshes import cases
from test_remote_import import stable_digest

from hybridckpt.cli import main
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests, tally


@pytest.mark.parametrize("name,mesh", cases([("hf", "fsdp=2,tp=2"), ("dcp", "fsdp=4,tp=2")]))
def test_import_from_gcs_equals_import_from_disk(gcs, local_sources, tmp_path, capsys, name, mesh):
    local = local_sources[name]
    url = remote_sources.in_gcs_bucket(local)
    assert main(["import", local, str(tmp_path / "from_disk"), "--mesh", mesh]) == 0
    with count_reads() as reads:
        assert main(["import", url, str(tmp_path / "from_bucket"), "--mesh", mesh]) == 0
    capsys.readouterr()
    a, b = stable_digest(tmp_path / "from_disk"), stable_digest(tmp_path / "from_bucket")
    assert sorted(a) == sorted(b) and len(a) > 3
    assert [k for k in a if a[k] != b[k]] == []  # bitwise, every file
    needed, _, _, _ = tally(reads)
    (got,) = remote_requests(reads).values()
    data = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local)
               if f.endswith((".safetensors", ".distcp")))
    assert 0 < got["bytes"] <= 1.1 * needed and got["bytes"] <= 1.1 * data, (got, needed, data)


def test_export_to_gcs_equals_the_local_export(gcs, local_sources, tmp_path, capsys):
    from gcsfs.core import GCSFileSystem

    local = local_sources["hf"]
    assert main(["export", local, str(tmp_path / "out"), "--to", "hf"]) == 0
    fs = GCSFileSystem(skip_instance_cache=True)
    if not fs.exists("out"):
        fs.mkdir("out")
    assert main(["export", local, "gs://out/hf", "--to", "hf"]) == 0
    capsys.readouterr()
    mine = sorted(os.listdir(tmp_path / "out"))
    theirs = sorted(p.rsplit("/", 1)[1] for p in fs.ls("out/hf"))
    assert theirs == mine
    for f in mine:
        if f == ".hybridckpt-export":
            continue  # (lists the same files; sizes compared below)
        assert fs.cat_file(f"out/hf/{f}") == (tmp_path / "out" / f).read_bytes(), f
