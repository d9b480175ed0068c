"""MaxText 0.2.5's DeepSeek V3.2 against `export --to maxtext` (tests/real/generators/
_maxtext_deepseek_v32.py wrote `maxtext_deepseek_v32`: MaxText restored our weights-only export of
transformers' `hf524_deepseek_v32` into its `deepseek` decoder block, scanned and unscanned, ran
its forward to transformers' logits, and saved the params it restored, the router bias under
`params` as its converter stores it).

Here: MaxText's save read back as a source is hf524_deepseek_v32's weights (fp32: MaxText's
weight_dtype, exactly the bf16 values) and runs, in our model, to MaxText's own logits; our export
cast to fp32 is MaxText's save bit for bit (two stacks, `decoder.dense_layers` and
`decoder.moe_layers`; the router bias, a MaxText variable, with its layer axis first); MaxText's
save imported onto a mesh and exported again is MaxText's save bit for bit; the unscanned export
reads back; the overrides, notes and refusals.
"""

from __future__ import annotations

import json
import os
from functools import partial

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from maxtext_cases import config_dict, config_file, exported_back, params, rel

from hybridckpt import jobs, lazy, models
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.formats.registry import detect
from hybridckpt.jobs.open import open_checkpoint

SOURCE, CASE = "hf524_deepseek_v32", "maxtext_deepseek_v32"
BIAS = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"


_config_dict = partial(config_dict, SOURCE)  # (**over) -> the source's config.json, keys changed
_config_file = partial(config_file, source=SOURCE)  # (tmp_path, **over) -> that written as a file


def _weights() -> dict[str, np.ndarray]:
    """hf524_deepseek_v32's weights (its reference: the bf16 checkpoint's values in fp32)."""
    return {k: v for k, v in reference(SOURCE).items() if k not in ("logits", "tokens")}


def test_maxtexts_save_reads_back_as_the_transformers_weights(tmp_path):
    """MaxText's save with the source's config.json: every HF tensor of hf524_deepseek_v32, its
    values exactly (fp32), the router's score-correction bias included; no optimizer state, no note."""
    path = ckpt(CASE)
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_config_file(tmp_path))
    named = opened.named
    want = _weights()
    assert sorted(named.params) == sorted(want)
    for k, v in want.items():
        got = named.params[k].materialize()
        assert got.dtype == np.float32 and np.array_equal(got, v), k
    assert np.any(named.params["model.layers.3.mlp.gate.e_score_correction_bias"].materialize() != 0)
    assert named.step == 0 and not named.slots and opened.notes == ()


def test_maxtexts_forward_is_transformers():
    """The generator's record: MaxText's forward of our export (scanned, unscanned, sparse MoE
    path) is transformers' DeepseekV32ForCausalLM (rel 1e-5; fp32 both sides)."""
    ref = reference(CASE)
    for key in ("logits_maxtext", "logits_maxtext_unscanned", "logits_maxtext_sparse"):
        assert rel(ref[key], ref["logits_hf"]) < 1e-5, key
    assert np.array_equal(ref["logits_hf"], reference(SOURCE)["logits"])
    assert np.array_equal(ref["tokens"], reference(SOURCE)["tokens"])
    assert manifest(CASE)["versions"]["maxtext"] == "0.2.5"


def test_our_model_runs_maxtexts_save_to_maxtexts_logits(tmp_path):
    ref = reference(CASE)
    got = jobs.logits(ckpt(CASE), ref["tokens"], config=_config_file(tmp_path))
    assert rel(got, ref["logits_maxtext"]) < 1e-5


def test_our_export_is_maxtexts_save_bit_for_bit(tmp_path):
    """`export --to maxtext` of transformers' checkpoint (cast to fp32, MaxText's weight_dtype):
    MaxText's saved params, names and values bit for bit; the router bias [layers, experts] (a
    MaxText variable: its layer axis stays first), every other stacked array's layer axis 1."""
    out = tmp_path / "ours"
    jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext", dtype="float32")
    ours, theirs = params(str(out / "0" / maxtext.ITEM)), params(ckpt(CASE, "0", maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    assert ours[BIAS].shape == (2, 4)  # [moe layers, experts]
    assert ours["params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"].shape == (4, 2, 16, 8)
    assert ours["params.params.decoder.dense_layers.self_attention.indexer.wq_b.kernel"].shape == (8, 2, 4, 8)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k
    written = json.loads((out / "maxtext_overrides.json").read_text())
    assert written["overrides"] == manifest(CASE)["overrides"]["overrides"]  # what MaxText ran with


def test_imported_maxtext_save_exports_back_bit_for_bit(tmp_path):
    """MaxText's save imported onto a mesh (with the config) and exported to MaxText again: its
    params bit for bit; unscanned, one `decoder.dense_layers_<i>` / `decoder.moe_layers_<i>` per
    layer (the MoE ones counted from 0), read back to the weights."""
    store = exported_back(tmp_path, CASE, _config_file(tmp_path))
    flat = tmp_path / "flat"
    jobs.export_checkpoint(store, flat, to="maxtext", options={"scan_layers": False})
    names = sorted(item_arrays(str(flat / "0" / maxtext.ITEM)))
    assert "params.params.decoder.moe_layers_1.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias" in names
    assert "params.params.decoder.dense_layers_1.self_attention.indexer.wk.kernel" in names
    assert not any(n.startswith(("params.params.decoder.moe_layers.", "params.params.decoder.moe_layers_2"))
                   for n in names)
    named = open_checkpoint(str(flat), config=_config_file(tmp_path)).named
    for k, v in _weights().items():
        assert np.array_equal(named.params[k].materialize(), v), k


def _cfg(**over):
    return models.config_from_hf(_config_dict(**over))


def test_overrides_and_notes():
    o = maxtext.overrides(_cfg())
    assert (o["model_name"], o["decoder_block"], o["attention_type"], o["rope_type"]) == (
        "deepseek3.2-671b", "deepseek", "mla", "yarn")
    assert (o["first_num_dense_layers"], o["base_num_decoder_layers"], o["num_experts"], o["shared_experts"]) == (2, 4, 4, 1)
    assert (o["n_routing_groups"], o["topk_routing_group"], o["routed_bias"]) == (2, 1, True)
    assert (o["rope_factor"], o["original_max_position_embeddings"], o["mscale"]) == (4.0, 16, 1.0)
    assert (o["indexer_n_heads"], o["indexer_head_dim"], o["indexer_topk"]) == (4, 8, 4)
    assert maxtext.notes(_cfg()) == [] and maxtext.layer_axis_0(_cfg()) == ("DeepSeekMoeBlock_0.MoeBlock_0.gate.bias",)
    # one group: MaxText's group routing off
    assert maxtext.overrides(_cfg(n_group=1, topk_group=1))["n_routing_groups"] == -1
    # HF's cos/sin factor (mscale 1 vs mscale_all_dim 0.707) has no MaxText counterpart: said
    rope = dict(_config_dict()["rope_parameters"], mscale_all_dim=0.707)
    assert any("attention_factor 1.0" in n and "rotate positions differently" in n
               for n in maxtext.notes(_cfg(rope_parameters=rope)))
    assert any("norm_topk_prob false" in n for n in maxtext.notes(_cfg(norm_topk_prob=False)))


@pytest.mark.parametrize(("over", "match"), [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, r"rotates with YaRN .*'default'"),
])
def test_what_maxtext_cannot_build_is_refused_before_writing(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        maxtext.rules(_cfg(**over))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext", config=_config_file(tmp_path, **over))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["config.json"]


def test_mtp_modules_are_refused():
    from dataclasses import replace

    with pytest.raises(ConfigError, match=r"carries 1 MTP module\(s\)"):
        maxtext.rules(replace(_cfg(), mtp_layers=1, num_nextn_predict_layers=1))


def _arr(*shape):
    return lazy.as_lazy(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))


def test_two_stacks_and_the_axis_0_variable_both_ways_and_hostile_ones():
    """`decoder.dense_layers.X` / `decoder.moe_layers.X` (layers first) -> scanned (axis 1; the bias
    kept at 0) or per layer, and back; a scanned variable without a layer axis and an unscanned
    stack with a gap are refused in one line."""
    axis0 = ("gate.bias",)
    flat = {"decoder.dense_layers.a.kernel": _arr(2, 3, 5), "decoder.moe_layers.b.gate.bias": _arr(2, 4),
            "decoder.moe_layers.b.kernel": _arr(2, 3, 5)}
    disk = maxtext.to_disk(flat, True, axis0=axis0)
    assert disk["decoder.dense_layers.a.kernel"].shape == (3, 2, 5)
    assert np.array_equal(disk["decoder.moe_layers.b.gate.bias"].materialize(), flat["decoder.moe_layers.b.gate.bias"].materialize())
    back = maxtext.from_disk(disk, "x", axis0=axis0)
    for k, v in flat.items():
        assert np.array_equal(back[k].materialize(), v.materialize()), k
    unscanned = maxtext.to_disk(flat, False, axis0=axis0)
    assert sorted(unscanned) == ["decoder.dense_layers_0.a.kernel", "decoder.dense_layers_1.a.kernel",
                                 "decoder.moe_layers_0.b.gate.bias", "decoder.moe_layers_0.b.kernel",
                                 "decoder.moe_layers_1.b.gate.bias", "decoder.moe_layers_1.b.kernel"]
    read = maxtext.from_disk(unscanned, "x", axis0=axis0)
    for k, v in flat.items():
        assert np.array_equal(read[k].materialize(), v.materialize()), k
    with pytest.raises(FormatError, match=r"ckpt: decoder\.moe_layers\.b\.gate\.bias: a scanned array has a layer "
                                          r"axis 0, found shape \(\)"):
        maxtext.from_disk({"decoder.moe_layers.b.gate.bias": lazy.as_lazy(np.float32(1))}, "ckpt", axis0=axis0)
    gap = {k: v for k, v in unscanned.items() if not k.startswith("decoder.moe_layers_0.b.kernel")}
    with pytest.raises(FormatError, match=r"ckpt: decoder\.moe_layers_<i>\.b\.kernel: expected layers 0\.\.0, found \[1\]"):
        maxtext.from_disk(gap, "ckpt", axis0=axis0)


def test_a_config_of_other_layers_is_refused_reading_maxtexts_save(tmp_path):
    """MaxText's 4-layer save (2 MoE layers on the moe_layers scan axis) read with a 6-layer config:
    one line naming the missing layers, not a partial model."""
    config = _config_file(tmp_path, num_hidden_layers=6, layer_types=None, mlp_layer_types=None)
    out = tmp_path / "out"
    with pytest.raises(MappingError, match=r"cannot stack \S+: indices \[4, 5\] are missing"):
        jobs.export_checkpoint(ckpt(CASE), out, config=config)
    assert not out.exists()


def test_the_optimizer_is_refused_for_deepseek():
    """`--optimizer` (MaxText's DeepSeek Adam state: none for the router bias, which it keeps under
    nnx_aux) is refused in one line, rather than a train state MaxText would not restore as ours."""
    from types import SimpleNamespace

    from hybridckpt.formats.maxtext.write import maxtext_tensors

    params = {k: lazy.as_lazy(v) for k, v in _weights().items()}
    named = SimpleNamespace(params=params, slots={"exp_avg": params, "exp_avg_sq": params}, step=3)
    with pytest.raises(ConfigError, match=r"--optimizer: MaxText's DeepSeek train state keeps the router bias"):
        maxtext_tensors(named, _cfg(), optimizer=True)
    assert maxtext_tensors(named, _cfg(), optimizer=False)["step"] == 3  # the weights alone are written


def test_a_config_of_fewer_layers_is_refused_reading_maxtexts_save(tmp_path):
    """The save's moe_layers stack holds 2 layers where a 3-layer config wants 1: refused in one
    line (its tensors are not that model's), not the first layer taken and the rest dropped."""
    from hybridckpt.errors import HybridCkptError

    config = _config_file(tmp_path, num_hidden_layers=3, layer_types=None, mlp_layer_types=None)
    out = tmp_path / "out"
    with pytest.raises(HybridCkptError, match=r"this maxtext checkpoint's tensors are not that model's"):
        jobs.export_checkpoint(ckpt(CASE), out, config=config)
    assert not out.exists()
