"""The CLI on legacy torch formats: auto-detected by inspect, import, export, verify and logits."""

import json

import numpy as np
import torch
from fixtures.megatron_writer import make_llama, write_megatron
from fixtures.meta_writer import meta_llama_reference, write_meta
from meshes import fit

from hybridckpt.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_megatron_and_meta_through_every_command(tmp_path, capsys):
    meg, meta = str(tmp_path / "meg"), str(tmp_path / "meta")
    ref = make_llama(hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, vocab=100, seed=40)
    write_megatron(meg, ref, tp=2, pp=2, dist_optim=True, dtype=torch.bfloat16, iteration=9)
    mref = meta_llama_reference(seed=41)
    write_meta(meta, mref, mp=2, generation=2)
    for path, fmt in ((meg, "megatron"), (meta, "meta-llama")):
        code, out, _ = _run(capsys, "inspect", path, "--json")
        info = json.loads(out)
        assert code == 0 and info["format"] == fmt and not info["needs_config"]
        assert info["tensors"] and all(t["pieces"] >= 1 for t in info["tensors"])
    code, out, _ = _run(capsys, "inspect", meg)
    assert code == 0 and "pieces=2" in out and "format:    megatron" in out
    ckpt, exported = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    code, out, _ = _run(capsys, "import", meg, ckpt, "--mesh", fit("fsdp=2,tp=2,pp=2"), "--quiet")
    assert code == 0 and "with optimizer state" in out and "params taken from the fp32 master weights" in out
    assert _run(capsys, "export", ckpt, exported, "--optimizer", "--quiet")[0] == 0
    # the export holds the fp32 masters; the Megatron source's weights are bf16 copies of them
    code, out, _ = _run(capsys, "verify", meg, exported)
    assert code == 0, out
    code, out, _ = _run(capsys, "verify", meta, exported)
    assert code == 1 and "BAD" in out
    logits_a, logits_b = str(tmp_path / "a.npy"), str(tmp_path / "b.npy")
    assert _run(capsys, "logits", meg, "--tokens", "1,5,7,99", "--out", logits_a, "--mesh", fit("tp=2"))[0] == 0
    assert _run(capsys, "logits", exported, "--tokens", "1,5,7,99", "--out", logits_b)[0] == 0
    # another mesh may reorder fp32 reductions: equal to 1e-5
    np.testing.assert_allclose(np.load(logits_a), np.load(logits_b), atol=1e-5, rtol=0)
    assert _run(capsys, "logits", meta, "--tokens", "1,2", "--out", logits_a)[0] == 0
