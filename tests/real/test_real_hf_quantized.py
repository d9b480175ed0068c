"""Quantized HF releases (`generators/hf_quantized.py`), dequantized on import:

- `hf_fp8_qwen3`: written by transformers 5.24's fine-grained FP8 quantizer (16 x 16 blocks);
  references: transformers' own CPU dequantization (float32) and DeepSeek's `weight_dequant`.
- `deepseek_fp8_partial`: DeepSeek V3's layout with partial edge blocks; reference: DeepSeek's
  `weight_dequant` (float32).
- `gpt_oss_mxfp4`: written by the GPT-OSS converter (MXFP4 experts, shards from 0); reference:
  transformers' CPU dequantization (float32). Read as the gpt_oss family (`models/gpt_oss`); the
  same files under an architecture no family implements are read under their own names.

Params: bit for bit, float32 equal to the references; by default each tensor in the dtype it is
stored in: a dequantized one bfloat16 (`hf_quant.DEFAULT_DTYPE`) equal to bfloat16 of them (round
to nearest even), every unquantized one its own (the GPT-OSS converter's fp32 RMSNorm weights stay
fp32); after import on a mesh, restore on another and export. Logits against the tool's forward
(fp32, 1e-5).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from cases import ckpt, reference
from roundtrip_real import bitwise_equal, mesh_pair

from hybridckpt import jobs
from hybridckpt.formats.registry import open_source
from hybridckpt.lazy.dtypes import exact
from hybridckpt.lazy.quantized import BlockScaled

BF16 = np.dtype(ml_dtypes.bfloat16)
LOGITS_ATOL = 1e-5


def _refs(case: str, prefix: str) -> dict[str, np.ndarray]:
    return {k.split(":", 1)[1]: v for k, v in reference(case).items() if k.startswith(prefix + ":")}


def _want(case: str) -> dict[str, np.ndarray]:
    """Every tensor of the model as the references hold it (float32)."""
    if case == "deepseek_fp8_partial":
        return _refs(case, "unquantized") | _refs(case, "deepseek_weight_dequant")
    return _refs(case, "transformers")


def _stored_dtypes(case: str) -> dict[str, np.dtype]:
    """Each tensor's dtype as the safetensors headers of the case store it (read by safetensors
    itself), the quantized ones' parts included."""
    from safetensors import safe_open

    folder = ckpt(case)
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "np") as st:
                for k in st.keys():
                    out[k] = {"F32": np.dtype(np.float32), "BF16": BF16}.get(st.get_slice(k).get_dtype())
    return out


def _roundtrip(case: str, tmp_path, dtype: str | None) -> tuple[dict[str, np.ndarray], str]:
    a, b = mesh_pair()
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    jobs.import_checkpoint(ckpt(case), store, mesh=a, dtype=dtype)
    if a != b:  # restore on another mesh: a second import of the store re-shards it
        jobs.import_checkpoint(store, str(tmp_path / "store_b"), mesh=b)
        store = str(tmp_path / "store_b")
    jobs.export_checkpoint(store, out)
    exported = open_source(out)
    return {k: v.materialize() for k, v in exported.tensors.items()}, out


@pytest.mark.parametrize("case", ["hf_fp8_qwen3", "deepseek_fp8_partial", "gpt_oss_mxfp4"])
def test_reader_dequantizes_bit_for_bit(case):
    src = open_source(ckpt(case))
    want = _want(case)
    assert sorted(src.tensors) == sorted(want) or case == "hf_fp8_qwen3"
    for k, v in want.items():
        got = exact(src.tensors[k]).materialize().astype(np.float32)
        assert bitwise_equal(got, v), k


def test_fp8_transformers_and_deepseek_agree():
    """On full blocks the two tools' dequantizations are the same float32 values as ours."""
    ds, tf = _refs("hf_fp8_qwen3", "deepseek_weight_dequant"), _refs("hf_fp8_qwen3", "transformers")
    assert len(ds) == 14
    for k, v in ds.items():
        assert bitwise_equal(tf[k], v), k


@pytest.mark.parametrize("case", ["hf_fp8_qwen3", "deepseek_fp8_partial", "gpt_oss_mxfp4"])
@pytest.mark.parametrize("dtype", [None, "float32"])
def test_import_restore_export_bitwise(case, dtype, tmp_path):
    params, out = _roundtrip(case, tmp_path, dtype)
    want = _want(case)
    if case == "hf_fp8_qwen3":
        want = {k: v for k, v in want.items() if k in params}
    assert sorted(params) == sorted(want)
    stored = _stored_dtypes(case)
    if case == "gpt_oss_mxfp4":  # the converter keeps the RMSNorm weights fp32, the rest bf16
        assert sorted(k for k, d in stored.items() if d == np.float32) == sorted(k for k in want if "norm" in k)
    for k, v in want.items():
        # float32 -> bfloat16: nearest even; an unquantized tensor as the file stores it
        expect = v if dtype == "float32" else v.astype(stored.get(k) or BF16)
        assert bitwise_equal(params[k], expect), (k, params[k].dtype, expect.dtype)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert "quantization_config" not in cfg


def test_export_straight_from_the_release_keeps_each_stored_dtype(tmp_path):
    """`export RELEASE OUT` (no import): the dequantized experts bfloat16, the converter's fp32
    RMSNorm weights fp32, every other tensor as the file stores it; `--dtype float32` says what
    it cast."""
    want, stored = _want("gpt_oss_mxfp4"), _stored_dtypes("gpt_oss_mxfp4")
    jobs.export_checkpoint(ckpt("gpt_oss_mxfp4"), str(tmp_path / "out"))
    params = {k: v.materialize() for k, v in open_source(str(tmp_path / "out")).tensors.items()}
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v.astype(stored.get(k) or BF16)), k
    assert {str(params[k].dtype) for k in params if "norm" in k} == {"float32"}
    s = jobs.export_checkpoint(ckpt("gpt_oss_mxfp4"), str(tmp_path / "f32"), dtype="float32")
    n32 = sum(1 for k in want if stored.get(k) == np.float32)
    assert f"cast {len(want) - n32} tensors bfloat16->float32; {n32} already float32" in s.notes


def test_partial_edge_blocks_matter():
    """A block inferred as shape // grid (transformers 5.24's CPU dequantization) gives other
    values wherever a weight's edge blocks are partial: the reference catches it."""
    src = open_source(ckpt("deepseek_fp8_partial"))
    want = _refs("deepseek_fp8_partial", "deepseek_weight_dequant")
    wrong = 0
    for k, t in src.tensors.items():
        t = exact(t)
        if not isinstance(t, BlockScaled) or all(n % b == 0 for n, b in zip(t.shape, t.block, strict=True)):
            continue
        grid = t.scales.shape
        inferred = (max(1, t.shape[0] // grid[0]), max(1, t.shape[1] // grid[1]))
        try:
            naive = BlockScaled(t.values, t.scales, inferred).materialize()
        except Exception:  # noqa: BLE001 - a grid that does not fit is as wrong
            wrong += 1
            continue
        wrong += not np.array_equal(naive, want[k])
    assert wrong >= 10


def test_box_reads_touch_only_their_blocks():
    """A box of a dequantized tensor equals the box of the whole (partial blocks included)."""
    src = open_source(ckpt("deepseek_fp8_partial"))
    t = next(t for t in map(exact, src.tensors.values()) if isinstance(t, BlockScaled) and t.shape[0] % 16 and t.shape[1] % 16)
    whole = t.materialize()
    for box in (((3, t.shape[0] - 1), (5, 21)), ((16, t.shape[0]), (17, t.shape[1]))):
        np.testing.assert_array_equal(t.read_box(box), whole[box[0][0]:box[0][1], box[1][0]:box[1][1]])


@pytest.mark.parametrize("case", ["hf_fp8_qwen3", "deepseek_fp8_partial"])
def test_logits_equal_the_tools_forward(case):
    ref = reference(case)
    got = jobs.logits(ckpt(case), ref["tokens"], mesh=mesh_pair()[0])
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


def test_inspect_shows_the_quantization():
    info = jobs.inspect(ckpt("deepseek_fp8_partial"))
    assert info["quantization"]["quant_method"] == "fp8" and info["quantization"]["weight_block_size"] == [16, 16]
    assert info["quantization"]["dequantized_tensors"] == 28
    assert all(t["dtype"] in ("float32", "bfloat16") for t in info["tensors"])  # no fp8 / scale tensors listed
    assert not any(t["name"].endswith("_scale_inv") for t in info["tensors"])
    mx = jobs.inspect(ckpt("gpt_oss_mxfp4"))
    assert mx["quantization"]["quant_method"] == "mxfp4" and mx["config"]["family"] == "gpt_oss"
    assert mx["quantization"]["dequantized_tensors"] == 4


def test_gpt_oss_export_names_and_layout_as_transformers_holds_them(tmp_path):
    """The MXFP4 experts come out as transformers' runtime `mlp.experts.gate_up_proj`
    `[E, hidden, 2 * intermediate]` and `down_proj` `[E, intermediate, hidden]`; the export's
    config.json (the family's, without quantization_config) loads in transformers as the
    source's does, with the tool's logits."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    params, out = _roundtrip("gpt_oss_mxfp4", tmp_path, "float32")
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["GptOssForCausalLM"]
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    assert params["model.layers.0.mlp.experts.gate_up_proj"].shape == (e, h, 2 * i)
    assert params["model.layers.0.mlp.experts.down_proj"].shape == (e, i, h)
    assert not any(k.endswith(("_blocks", "_scales")) for k in params)
    ours, theirs = GptOssConfig.from_pretrained(out), GptOssConfig.from_pretrained(ckpt("gpt_oss_mxfp4"))
    for key in ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "rope_parameters",
                "swiglu_alpha", "swiglu_limit", "attention_bias", "head_dim", "num_key_value_heads",
                "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "vocab_size"):
        assert getattr(ours, key) == getattr(theirs, key), key
    model = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ref = reference("gpt_oss_mxfp4")
    with torch.no_grad():
        got = model(torch.from_numpy(ref["tokens"])).logits.numpy()
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=LOGITS_ATOL)


# transformers' own fp32 forward of this model is 3.1e-5 from its float64 forward (large expert
# activations: MXFP4 exponents up to 2^-2); ours is 2.2e-5 from it, 4.7e-5 from transformers' fp32
GPT_OSS_LOGITS_ATOL = 1e-4


def test_gpt_oss_release_imports_as_the_family_with_the_tools_logits(tmp_path):
    """The release imports onto the gpt_oss family's tree (experts fused `[L, X, E, 2M]`, split
    over the mesh by meaning), and its logits, from the files and from the store, are the tool's."""
    import jax

    from hybridckpt import models
    from hybridckpt.jobs.restore import restore

    ref = reference("gpt_oss_mxfp4")
    a, b = mesh_pair()
    store = str(tmp_path / "store")
    jobs.import_checkpoint(ckpt("gpt_oss_mxfp4"), store, mesh=a, dtype="float32")
    cfg = jobs.open_checkpoint(store).config
    assert cfg.family == "gpt_oss" and cfg.num_experts_per_tok == 4  # not the converter's experts_per_token 2
    _, r = restore(store, b, optimizer=False)
    assert jax.tree.map(lambda x: tuple(x.shape), r.params) == models.param_shape_tree(cfg)
    assert r.params["moe"]["experts"]["gate_up"]["kernel"].shape == (2, 4, 64, 64)
    for src in (ckpt("gpt_oss_mxfp4"), store):
        got = jobs.logits(src, ref["tokens"], mesh=b)
        np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=GPT_OSS_LOGITS_ATOL)


def _renamed_architecture(tmp_path) -> str:
    """The release's files with config.json naming an architecture no family implements."""
    folder = tmp_path / "unknown"
    folder.mkdir()
    for f in os.listdir(ckpt("gpt_oss_mxfp4")):
        os.symlink(ckpt("gpt_oss_mxfp4", f), folder / f)
    d = json.loads(open(ckpt("gpt_oss_mxfp4", "config.json")).read())
    os.unlink(folder / "config.json")
    (folder / "config.json").write_text(json.dumps(d | {"architectures": ["GptOssNextForCausalLM"],
                                                        "model_type": "gpt_oss_next"}))
    return str(folder)


def test_an_unknown_architecture_is_read_under_its_own_names(tmp_path):
    """Under an architecture no family implements, the dequantized tensors keep their runtime
    names, logits name the architecture, and an export writes the source's config.json back
    without quantization_config."""
    from hybridckpt.errors import ConfigError

    src = _renamed_architecture(tmp_path)
    assert jobs.inspect(src)["architecture"] == "GptOssNextForCausalLM"
    with pytest.raises(ConfigError, match="GptOssNextForCausalLM is not supported by any model family"):
        jobs.logits(src, [1, 2])
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    jobs.import_checkpoint(src, store, mesh=mesh_pair()[0], dtype="float32")
    jobs.export_checkpoint(store, out)
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    src_cfg = json.loads(open(os.path.join(src, "config.json")).read())
    assert cfg == {k: v for k, v in src_cfg.items() if k != "quantization_config"}
    params = {k: v.materialize() for k, v in open_source(out).tensors.items()}
    want = _want("gpt_oss_mxfp4")
    assert sorted(params) == sorted(want)
    for k, v in want.items():
        assert bitwise_equal(params[k], v), k


def test_mxfp4_nibble_order_and_bias_matter():
    """High nibble first, or an exponent bias of 128, gives other values than the tool's."""
    from hybridckpt.lazy import quantized as q

    src = open_source(ckpt("gpt_oss_mxfp4"))
    want = _refs("gpt_oss_mxfp4", "transformers")["model.layers.0.mlp.experts.down_proj"]
    blocks = exact(src.tensors["model.layers.0.mlp.experts.down_proj"]).src.blocks
    scales = exact(src.tensors["model.layers.0.mlp.experts.down_proj"]).src.scales
    ok = np.ascontiguousarray(q.Mxfp4(blocks, scales).materialize().transpose(0, 2, 1))
    assert bitwise_equal(ok, want)
    raw = blocks.materialize()
    from hybridckpt.lazy import ArrayTensor

    swapped = q.Mxfp4(ArrayTensor(((raw & 0x0F) << 4) | (raw >> 4)), scales).materialize().transpose(0, 2, 1)
    assert not np.array_equal(swapped, want)
    shifted = q.Mxfp4(blocks, ArrayTensor(scales.materialize() - 1)).materialize().transpose(0, 2, 1)
    assert not np.array_equal(shifted, want)
