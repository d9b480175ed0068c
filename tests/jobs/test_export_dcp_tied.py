"""`export --to dcp --optimizer` of a tied model, resumed by the real torch FSDP2 (split from
test_export_dcp.py: it shares none of that file's module fixtures, and as its own file
`--dist loadfile` can hand it to the other worker; that file is the longest of tests/jobs,
docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from fixtures import FIXTURES
from fixtures.torch_common import load_reference, reference_names
from test_export_dcp import resume

from hybridckpt import jobs
from hybridckpt.containers.dcp_metadata import read_metadata


def test_fsdp2_resumes_a_tied_model(tmp_path):
    """A tied model (the head is the embedding): its state dict lists `lm_head.weight` too, so the
    export writes it (a template key the checkpoint lacked would fail `dcp.load`); the optimizer
    state is the embedding's alone. A 2-rank run, exported directly, resumed on 1 rank."""
    from transformers import LlamaConfig

    cfg_dir = tmp_path / "cfg"
    cfg = LlamaConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    cfg.save_pretrained(cfg_dir)
    src = tmp_path / "run"
    subprocess.run([sys.executable, os.path.join(FIXTURES, "dcp_writer.py"), str(src), str(cfg_dir)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    out = str(tmp_path / "dcp")
    s = jobs.export_checkpoint(str(src / "fsdp2"), out, to="dcp", optimizer=True)
    assert any("tied head" in n for n in s.notes)
    md = read_metadata(out)
    head, embed = md.tensors["model.lm_head.weight"], md.tensors["model.model.embed_tokens.weight"]
    assert head.shape == embed.shape == (250, 64)
    assert not any("lm_head" in k for k in md.tensors if k.startswith("optim."))
    got = resume(out, 1, src, tmp_path / "res.npz", config=str(src / "fsdp2" / "config.json"))
    ref, _ = load_reference(src, "fsdp2")
    names = reference_names(got, "param")
    assert "lm_head.weight" not in names and len(names) == 20  # (named_parameters: the tie once)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        for n in names:
            assert np.array_equal(got[f"{kind}/{n}"], ref[f"{kind}/{n}"]), (kind, n)
    assert max(np.abs(got[f"next/{n}"] - ref[f"next/{n}"]).max() for n in names) == 0.0
