"""Every format read from a bucket equals the same read from disk, bitwise (issue 43).

For each format the registry reads (`formats.registry.READABLE`) that has a case written by the
real tool in the corpus (`tests/real/cases`, the smallest case per format, a few for the formats
that hold several layouts), the case's folder is uploaded to the test S3 server (moto,
`fixtures.s3_server`) and

- `import s3://...` equals `import` of the local folder bit for bit (every file of the two
  stores, `stable_digest`), on one small mesh;
- the bytes the import asked of the server (`io.read_tally.remote_requests`) are at most 1.1x the
  bytes its readers asked for (`io.read_tally.tally`: what the devices need, headers included);
- `inspect --json` sees the same as from disk.

Our own store (`test_store_s3_read.py`), HF and DCP written in process (`test_remote_import.py`)
and MaxText / compressed / OCDBT stores (read by TensorStore: their own tests) are not here.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import pytest
from fixtures import remote_sources
from meshes import fit
from test_remote_import import stable_digest

from hybridckpt.cli import main
from hybridckpt.formats.registry import READABLE
from hybridckpt.io.byte_source import count_reads
from hybridckpt.io.read_tally import remote_requests, tally
from hybridckpt.io.remote import ranged

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real"))
from cases import case_dir, ckpt  # noqa: E402 - tests/real is not a package

MESH = fit("fsdp=2")


class Case(NamedTuple):
    """A source of the corpus: case `case`, its folder `below` ckpt/ uploaded (under its own name,
    so a step folder keeps its step), `open` the path below that folder read as the source ("":
    the folder; a file: one object's URL), read as format `fmt`, with `--config` `config`
    (relative to tests/real/cases) where the uploaded folder carries none."""

    case: str
    below: str
    fmt: str
    config: str | None = None
    open: str = ""  # noqa: A003 - a field's name
    whole_files: bool = False  # files each smaller than a request's least (see `exact_ranges`)


ZERO2 = "hf_trainer_deepspeed_zero2/ckpt/checkpoint-3/config.json"
CASES: dict[str, Case] = {
    "megatron-dist": Case("megatron_core_llama4_torch_dist", "", "megatron-dist"),
    "megatron-legacy": Case("megatron_lm_glm45_torch", "", "megatron"),
    "meta-llama-mp2": Case("meta_llama2_gqa_mp2", "", "meta-llama"),
    "mistral-consolidated": Case("mistral_swa", "", "meta-llama"),
    "flex-checkpoint": Case("paddleformers_ernie4_5", "flex", "flex-checkpoint"),
    "hf-trainer-index": Case("hf_trainer_index", "", "hf-trainer"),
    "fsdp2-dcp": Case("hf_trainer_fsdp2_sharded", "checkpoint-3/pytorch_model_fsdp_0", "dcp",
                      "hf_trainer_fsdp2_sharded/ckpt/config.json"),  # torch DCP as FSDP2 wrote it
    "deepspeed-zero2": Case("hf_trainer_deepspeed_zero2", "checkpoint-3/global_step3", "deepspeed", ZERO2),
    "deepspeed-universal": Case("deepspeed_universal_zero2", "", "deepspeed-universal", ZERO2, whole_files=True),
    "lightning-file": Case("lightning_ckpt_index", "", "lightning"),
    "paddle-legacy": Case("paddlenlp_untied_fp32_1rank", "legacy/checkpoint-3", "paddle"),
    "paddle-unified": Case("paddleformers_tied_bf16_1rank", "unified/checkpoint-3", "paddle-unified"),
    "colossal-safetensors": Case("colossal_tp2_sharded_safetensors", "", "colossal",
                                 "colossal_tp2_sharded_safetensors/hf_config.json"),
    "hf-bin": Case("hf_bin_qwen2_tied", "", "hf"),
    "torch-file": Case("hf_bin_qwen2_tied", "", "torch"),  # a folder holding one torch.save file
}
NOT_HERE = {"orbax", "maxtext"}  # our store and MaxText: their own tests (see the module doc)


def _sources(server, name: str) -> tuple[str, str, list[str]]:
    """(the local source, the same source in a bucket of `server`, the arguments its reads take)."""
    c = CASES[name]
    folder = ckpt(c.case, *c.below.split("/")) if c.below else ckpt(c.case)
    url = remote_sources.in_bucket(server, folder, keep_name=True)
    args = ["--format", c.fmt, *(["--config", os.path.join(os.path.dirname(case_dir(c.case)), c.config)]
                                 if c.config else [])]
    if c.open:
        return os.path.join(folder, c.open), f"{url}/{c.open}", args
    return folder, url, args


def exact_ranges(monkeypatch) -> None:
    """Requests cut to the ranges read: no gap coalesced, no read-ahead. The cases are 50 KB to
    1 MB where real checkpoints are GBs; at the default 64 KiB every gap between the KB-size
    tensors of a case is fetched (and a header walk's read-ahead covers whole files), which says
    nothing of a real read (`test_remote_import.py` bounds the defaults on larger files). Scaled
    to zero, what is asked of the server is at most what the readers read. DeepSpeed's universal
    checkpoint is a torch.save file of a few hundred bytes per slot and tensor (84 of them): a
    request per pickle opcode run would be a thousand GETs; read with the defaults, each of its
    files is fetched at most once (`whole_files`)."""
    monkeypatch.setattr(ranged, "COALESCE_GAP_BYTES", 0)
    monkeypatch.setattr(ranged, "READAHEAD_BYTES", 0)


def test_every_readable_format_has_a_case():
    assert {f.name for f in READABLE} - NOT_HERE == {c.fmt for c in CASES.values()}


def _run(capsys, argv) -> str:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.parametrize("name", sorted(CASES))
def test_format_from_bucket_equals_from_disk(s3, monkeypatch, tmp_path, capsys, name):
    local, url, args = _sources(s3, name)
    here = json.loads(_run(capsys, ["inspect", local, "--json", *args]))
    there = json.loads(_run(capsys, ["inspect", url, "--json", *args]))
    assert here.pop("path") == local and there.pop("path") == url
    assert json.loads(json.dumps(here).replace(local, url)) == there and here["tensors"]  # notes name the URL

    _run(capsys, ["import", local, str(tmp_path / "from_disk"), "--mesh", MESH, *args])
    if not CASES[name].whole_files:
        exact_ranges(monkeypatch)
    with count_reads() as reads:
        summary = json.loads(_run(capsys, ["import", url, str(tmp_path / "from_bucket"), "--mesh", MESH,
                                           "--json", *args]))
    a, b = stable_digest(tmp_path / "from_disk"), stable_digest(tmp_path / "from_bucket")
    a = {k: v.replace(local.encode(), url.encode()) if k.endswith("trainer_state/metadata") else v  # (its notes)
         for k, v in a.items()}
    assert sorted(a) == sorted(b) and len(a) > 3
    assert [k for k in a if a[k] != b[k]] == [], [_diff(a[k], b[k]) for k in a if a[k] != b[k]]  # bitwise, every file
    assert summary["source"] == url

    needed, _, _, _ = tally(reads)  # the bytes the readers asked for
    host = f"127.0.0.1:{s3.port}"
    got = remote_requests(reads)
    if CASES[name].whole_files:  # each file at most once
        files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(local) for f in fs)
        assert list(got) == [host] and 0 < got[host]["bytes"] <= files, (got, needed, files)
    else:
        assert list(got) == [host] and 0 < got[host]["bytes"] <= 1.1 * needed, (got, needed)


def _diff(x: bytes, y: bytes) -> str:
    try:
        x, y = json.loads(x), json.loads(y)
        return str({k: (str(x.get(k))[:300], str(y.get(k))[:300]) for k in set(x) | set(y) if x.get(k) != y.get(k)})
    except ValueError:
        return "binary"
