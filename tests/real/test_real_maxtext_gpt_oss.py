"""MaxText 0.2.5's GPT-OSS against `export --to maxtext` (tests/real/generators/_maxtext_gpt_oss.py
wrote `maxtext_gpt_oss`: MaxText restored our weights-only export of the transformers-written MXFP4
case `gpt_oss_mxfp4` (experts dequantized to bf16, exactly) into its `gpt_oss` decoder block,
scanned and unscanned, ran its forward, and saved the params it restored, fp32, as its converters
save weights).

Here: MaxText's save read back as a source is gpt_oss_mxfp4's weights (transformers' dequantized
values, bit for bit: the interleaved gate_up from MaxText's wi_0 / wi_1) and runs in our model to
MaxText's own logits; our export is MaxText's save (names, values; scanned as
`decoder.layers.layers_0` sliding / `layers_1` full); MaxText's save imported and exported again is
its save bit for bit; the overrides, notes and refusals (layer kinds MaxText cannot derive, a RoPE
it does not have).
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from maxtext_cases import config_dict, config_file, exported_back, params, rel

from hybridckpt import jobs, models
from hybridckpt.errors import ConfigError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.formats.registry import detect
from hybridckpt.jobs.open import open_checkpoint

SOURCE, CASE = "gpt_oss_mxfp4", "maxtext_gpt_oss"
TOLERANCE = 1e-4  # max |a - b| / max |b| of fp32 forwards (MaxText vs transformers was 7.3e-6)


_config_dict = partial(config_dict, SOURCE)  # (**over) -> the source's config.json, keys changed
_config_file = partial(config_file, source=SOURCE)  # (tmp_path, **over) -> that written as a file


def test_maxtexts_save_reads_back_as_the_transformers_weights(tmp_path):
    """MaxText's save (scanned: layers_0 / layers_1) with the source's config.json: every HF tensor
    of gpt_oss_mxfp4 as transformers dequantized it (the case's recorded parameters), bit for bit;
    gate_up_proj interleaved again from MaxText's wi_0 / wi_1; no optimizer state, no notes."""
    path = ckpt(CASE)
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_config_file(tmp_path))
    got = opened.named
    ref = reference(SOURCE)
    want = {k.removeprefix("transformers:"): v for k, v in ref.items() if k.startswith("transformers:")}
    assert sorted(got.params) == sorted(want)
    for k, v in want.items():
        theirs = got.params[k].materialize()
        assert theirs.dtype == np.float32 and np.array_equal(theirs, v.astype(np.float32)), k
    assert got.step == 0 and not got.slots and not opened.notes


def test_maxtexts_forward_is_transformers():
    """The generator's record: MaxText's forward of our export, scanned and unscanned, is the
    case's transformers GptOssForCausalLM logits (rel 1e-4; it was 7.3e-6)."""
    ref = reference(CASE)
    assert np.array_equal(ref["logits_hf"], reference(SOURCE)["logits"])
    for key in ("logits_maxtext", "logits_maxtext_unscanned"):
        assert rel(ref[key], ref["logits_hf"]) < TOLERANCE, key
    assert np.array_equal(ref["tokens"], reference(SOURCE)["tokens"])
    assert manifest(CASE)["versions"]["maxtext"] == "0.2.5"


def test_our_model_runs_maxtexts_save_to_maxtexts_logits(tmp_path):
    ref = reference(CASE)
    got = jobs.logits(ckpt(CASE), ref["tokens"], config=_config_file(tmp_path))
    assert rel(got, ref["logits_maxtext"]) < TOLERANCE


def test_our_export_is_maxtexts_save_and_exports_back(tmp_path):
    """`export --to maxtext` of the MXFP4 checkpoint: MaxText's saved params under the same names,
    its fp32 values our bf16 exactly, the overrides MaxText ran with; MaxText's save imported and
    exported again: its params bit for bit."""
    out = tmp_path / "ours"
    jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext")
    ours, theirs = params(str(out / "0" / maxtext.ITEM)), params(ckpt(CASE, "0", maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    assert "params.params.decoder.layers.layers_1.GptOssAttention.sinks" in ours
    assert "params.params.decoder.layers.layers_0.GptOssMlp.wi_1_bias" in ours
    for k, v in theirs.items():
        assert ours[k].shape == v.shape and np.array_equal(ours[k].astype(np.float32), v), k
    written = json.loads((out / "maxtext_overrides.json").read_text())
    assert written["overrides"] == manifest(CASE)["overrides"]["overrides"]
    exported_back(tmp_path, CASE, _config_file(tmp_path), mesh="dp=1")


def _cfg(**over):
    return models.config_from_hf(_config_dict(**over))


def test_overrides_and_notes():
    o = maxtext.overrides(_cfg())
    assert (o["model_name"], o["decoder_block"], o["inhomogeneous_layer_cycle_interval"]) == (
        "gpt-oss-20b", "gpt_oss", 2)
    assert (o["sliding_window_size"], o["attention_sink"], o["mlp_activations_limit"], o["base_moe_mlp_dim"]) == (
        4, True, 7.0, 32)
    assert (o["rope_type"], o["rope_factor"], o["original_max_position_embeddings"], o["rope_interleave"]) == (
        "yarn", 32.0, 4096, False)
    assert maxtext.notes(_cfg()) == []
    assert any("swiglu_alpha is 1.5" in n for n in maxtext.notes(_cfg(swiglu_alpha=1.5)))


@pytest.mark.parametrize(("over", "match"), [
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types \['full_attention', 'sliding_attention'\]"),
    ({"layer_types": ["sliding_attention"] * 3, "num_hidden_layers": 3}, r"of 3 layers are not of that form"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, r"this model's rope_type is 'default'"),
])
def test_what_maxtext_cannot_build_is_refused(over, match):
    """Layer kinds MaxText's gpt_oss block does not build (it slides on even layers), and a RoPE
    other than YaRN, are refused by the mapping (the export asks it before writing anything)."""
    with pytest.raises(ConfigError, match=match):
        maxtext.rules(_cfg(**over))
