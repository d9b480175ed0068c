"""GLM-4.5 and ERNIE 4.5 as transformers 5.24's `save_pretrained` wrote them
(`generators/hf524_fam_b.py`), in bf16 as the releases: GLM-4.5 and ERNIE 4.5 MoE with their router
weight and correction bias in fp32 (ERNIE's `[1, E]` under its stored name `mlp.moe_statics.*`),
ERNIE 4.5 dense with head_dim apart from hidden / heads.

The reader gives every tensor in its stored dtype, bit for bit what transformers held; import onto
dp=1,fsdp=2,tp=2,pp=2 (fewer devices: the largest mesh of that form), restore onto dp=2,tp=2,pp=2
and export give every tensor back bit for bit in its stored dtype, and transformers loads the
export to its own forward of the source folder bit for bit (the recorded logits within 1e-5: another CPU); our logits equal transformers' recorded fp32 forward (atol 1e-4).
`export --to maxtext` is refused naming the family (MaxText 0.2.5 has none of them).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from e2e import roundtrip
from meshes import fit

from hybridckpt import jobs
from hybridckpt.errors import ConfigError
from hybridckpt.formats.registry import open_source

CASES = {"hf524_glm4_moe": "glm4_moe", "hf524_ernie4_5_moe": "ernie4_5_moe", "hf524_ernie4_5": "ernie4_5"}
MESH_A, MESH_B = "dp=1,fsdp=2,tp=2,pp=2", "dp=2,tp=2,pp=2"
LOGITS_ATOL = 1e-4


def _weights(ref: dict) -> dict:
    return {k: v for k, v in ref.items() if k not in ("logits", "tokens")}


def _stored(path: str) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, raw values) of a safetensors file, read from its header and bytes alone
    (bf16 as uint16): the file as written, nothing of ours in between."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        body = f.read()
    out = {}
    for k, meta in header.items():
        if k == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        dt = {"BF16": np.uint16, "F32": np.float32}[meta["dtype"]]
        out[k] = (meta["dtype"], np.frombuffer(body[lo:hi], dt).reshape(meta["shape"]))
    return out


@pytest.mark.parametrize("case", CASES)
def test_reader_gives_the_stored_dtypes_bit_for_bit(case):
    src = open_source(ckpt(case))
    want, dtypes = _weights(reference(case)), manifest(case)["dtypes"]
    assert sorted(src.tensors) == sorted(want) == sorted(dtypes)
    for k, v in want.items():
        got = src.tensors[k].materialize()
        assert got.dtype.name == dtypes[k], k
        assert np.array_equal(got.astype(np.float32), v), k  # bf16 -> fp32 is exact


@pytest.mark.parametrize("case", CASES)
def test_config_is_read_as_the_family(case):
    cfg = jobs.open_checkpoint(ckpt(case)).config
    assert cfg.family == CASES[case]
    if case == "hf524_glm4_moe":
        assert (cfg.rotary_dim, cfg.use_qk_norm, cfg.attention_bias, cfg.num_dense_layers) == (4, True, True, 2)
        assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.mtp_layers) == (2, 1, 2.5, 0)
        assert {k for k, v in manifest(case)["dtypes"].items() if v == "float32"} == {
            f"model.layers.{i}.mlp.gate.{w}" for i in (2, 3) for w in ("weight", "e_score_correction_bias")}
    if case == "hf524_ernie4_5_moe":
        assert (cfg.moe_layers, cfg.moe_num_shared_experts, cfg.tie_word_embeddings, cfg.use_bias) == ((2, 3), 2, True, False)
        assert {k for k, v in manifest(case)["dtypes"].items() if v == "float32"} == {
            f"model.layers.{i}.mlp.{w}" for i in (2, 3) for w in ("gate.weight", "moe_statics.e_score_correction_bias")}
        assert reference(case)["model.layers.2.mlp.moe_statics.e_score_correction_bias"].shape == (1, 4)
    if case == "hf524_ernie4_5":
        assert (cfg.head_dim, cfg.num_heads, cfg.hidden_size, cfg.tie_word_embeddings) == (12, 2, 16, True)
        assert set(manifest(case)["dtypes"].values()) == {"bfloat16"}


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=fit(MESH_A))
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", CASES)
def test_import_restore_export_bitwise_and_transformers_loads_it(case, tmp_path):
    params, *_ = roundtrip(ckpt(case), str(tmp_path), mesh_a=MESH_A, mesh_b=MESH_B, optimizer=False)
    stored = _stored(ckpt(case, "model.safetensors"))
    assert sorted(params) == sorted(stored)
    for k, (dtype, raw) in stored.items():
        got = params[k]
        assert got.dtype.name == {"BF16": "bfloat16", "F32": "float32"}[dtype] and got.shape == raw.shape, k
        assert np.array_equal(got.view(raw.dtype), raw), k
    exported = os.path.join(str(tmp_path), "exported")
    written = _stored(os.path.join(exported, "model.safetensors"))
    assert {k: (d, v.tobytes()) for k, (d, v) in written.items()} == {k: (d, v.tobytes()) for k, (d, v) in stored.items()}
    import torch
    import transformers

    def forward(folder: str) -> np.ndarray:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
        with torch.no_grad():
            return model(torch.from_numpy(ref["tokens"].astype(np.int64))).logits.numpy()

    ref = reference(case)
    logits = forward(exported)
    # the export's forward is transformers' forward of the folder it wrote, bit for bit (same
    # weights, same code, this machine's kernels); against the logits recorded on the generator's
    # machine, within CPU-kernel rounding: an AMD EPYC VM's oneDNN/MKL sums differ from the
    # recording's by up to 2.0e-6 (glm4_moe), so 1e-5 there
    assert np.array_equal(logits, forward(ckpt(case)))
    np.testing.assert_allclose(logits, ref["logits"], rtol=0, atol=1e-5)
    # MaxText 0.2.5 has none of these families: the refusal names it, and nothing is written
    refused = os.path.join(str(tmp_path), "maxtext")
    with pytest.raises(ConfigError, match=f"MaxText: no mapping for family '{CASES[case]}'"):
        jobs.export_checkpoint(os.path.join(str(tmp_path), "orbax"), refused, to="maxtext")
    assert not os.path.exists(refused)
