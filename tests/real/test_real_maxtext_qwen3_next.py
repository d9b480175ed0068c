"""MaxText 0.2.5's Qwen3-Next against `export --to maxtext` (tests/real/generators/
_maxtext_qwen3_next.py wrote `maxtext_qwen3_next`: MaxText restored our weights-only export of
transformers' `hf524_qwen3_next` (bf16) into its `qwen3_next` decoder block, scanned and unscanned,
ran its forward, and saved the params it restored, fp32, as its converters save weights).

Here: MaxText's save read back as a source is hf524_qwen3_next's weights (fp32 of the bf16, bit
for bit: no value op) and runs in our model to MaxText's own logits; our export is MaxText's save
(names, values; scanned as `decoder.layers.local_layers` / `global_layer`); MaxText's save
imported onto a mesh and exported again is its save bit for bit, unscanned it reads back; the
overrides, notes and refusals (layer kinds MaxText cannot derive, dense layers, hostile scanned
arrays).
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
from cases import ckpt, manifest, reference
from maxtext_cases import config_dict, config_file, exported_back, params, rel

from hybridckpt import jobs, lazy, models
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.formats.maxtext import scan_groups
from hybridckpt.formats.registry import detect
from hybridckpt.jobs.open import open_checkpoint

SOURCE, CASE = "hf524_qwen3_next", "maxtext_qwen3_next"
TOLERANCE = 1e-5  # max |a - b| / max |b| of fp32 forwards (MaxText's chunked delta rule vs torch's, ours)


_config_dict = partial(config_dict, SOURCE)  # (**over) -> the source's config.json, keys changed
_config_file = partial(config_file, source=SOURCE)  # (tmp_path, **over) -> that written as a file


def test_maxtexts_save_reads_back_as_the_transformers_weights(tmp_path):
    """MaxText's save (scanned: local_layers / global_layer) with the source's config.json: every
    HF tensor of hf524_qwen3_next, fp32 of its bf16 bit for bit; no optimizer state, no notes."""
    path = ckpt(CASE)
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_config_file(tmp_path))
    got = opened.named
    want = open_checkpoint(ckpt(SOURCE)).named.params
    assert sorted(got.params) == sorted(want)
    for k, v in want.items():
        theirs = got.params[k].materialize()
        assert theirs.dtype == np.float32 and np.array_equal(theirs, v.materialize().astype(np.float32)), k
    assert got.step == 0 and not got.slots and not opened.notes


def test_a_config_of_other_layers_is_refused_reading_maxtexts_save(tmp_path):
    """MaxText's one-block save read with an 8-layer config: its scan axis holds 1 block where the
    config wants 2 (one line naming the array and both), not a silent partial model."""
    config = _config_file(tmp_path, num_hidden_layers=8, layer_types=None, full_attention_interval=4)
    with pytest.raises(FormatError, match=r"items: decoder\.layers\.(local_layers|global_layer)\.\S+: expected "
                                          r"\(2(, 3)?,?\) \(blocks.* of the 8 layers\) on axes from 1, found shape"):
        assert not open_checkpoint(ckpt(CASE), config=config).named.params


def test_what_maxtext_computes_differently_is_noted_in_the_export(tmp_path):
    """`norm_topk_prob: false` is written (the weights are right) with the note in
    maxtext_overrides.json, and the override MaxText would otherwise not know."""
    out = tmp_path / "out"
    jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext", config=_config_file(tmp_path, norm_topk_prob=False))
    written = json.loads((out / "maxtext_overrides.json").read_text())
    assert written["overrides"]["norm_topk_prob"] is False
    assert [n for n in written["notes"] if "norm_topk_prob=false" in n]


def test_maxtexts_forward_is_transformers():
    """The generator's record: MaxText's forward of our export, scanned and unscanned, is
    transformers' Qwen3NextForCausalLM of the same weights (rel 1e-5; it was 3.6e-6)."""
    ref = reference(CASE)
    for key in ("logits_maxtext", "logits_maxtext_unscanned"):
        assert rel(ref[key], ref["logits_hf"]) < TOLERANCE, key
    assert np.allclose(ref["logits_hf"], reference(SOURCE)["logits"], rtol=0, atol=1e-5)
    assert np.array_equal(ref["tokens"], reference(SOURCE)["tokens"])
    assert manifest(CASE)["versions"]["maxtext"] == "0.2.5"


def test_our_model_runs_maxtexts_save_to_maxtexts_logits(tmp_path):
    ref = reference(CASE)
    got = jobs.logits(ckpt(CASE), ref["tokens"], config=_config_file(tmp_path))
    assert rel(got, ref["logits_maxtext"]) < TOLERANCE


def test_our_export_is_maxtexts_save(tmp_path):
    """`export --to maxtext` of transformers' bf16 checkpoint: MaxText's saved params under the same
    names, its fp32 values our bf16 exactly; the overrides MaxText ran with."""
    out = tmp_path / "ours"
    jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext")
    ours, theirs = params(str(out / "0" / maxtext.ITEM)), params(ckpt(CASE, "0", maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    assert "params.params.decoder.layers.local_layers.attention.conv1d.kernel" in ours
    assert "params.params.decoder.layers.global_layer.mlp.routed_experts.wo" in ours
    for k, v in theirs.items():
        assert ours[k].shape == v.shape and np.array_equal(ours[k].astype(np.float32), v), k
    written = json.loads((out / "maxtext_overrides.json").read_text())
    assert written["overrides"] == manifest(CASE)["overrides"]["overrides"]


def test_imported_maxtext_save_exports_back_bit_for_bit(tmp_path):
    """MaxText's save imported onto a mesh (with the config) and exported to MaxText again: its
    params bit for bit; unscanned, one `decoder.layers_<i>` per layer, read back to the weights."""
    store = exported_back(tmp_path, CASE, _config_file(tmp_path))
    flat = tmp_path / "flat"
    jobs.export_checkpoint(store, flat, to="maxtext", options={"scan_layers": False})
    names = sorted(item_arrays(str(flat / "0" / maxtext.ITEM)))
    assert "params.params.decoder.layers_3.attention.attention.query.kernel" in names
    assert "params.params.decoder.layers_2.attention.in_proj_qkvz.kernel" in names
    assert not any("local_layers" in n or "global_layer" in n for n in names)
    named = open_checkpoint(str(flat), config=_config_file(tmp_path)).named
    want = open_checkpoint(ckpt(CASE), config=_config_file(tmp_path)).named.params
    for k, v in want.items():
        assert np.array_equal(named.params[k].materialize(), v.materialize()), k


def _cfg(**over):
    return models.config_from_hf(_config_dict(**over))


def test_overrides_and_notes():
    o = maxtext.overrides(_cfg())
    assert (o["model_name"], o["decoder_block"], o["inhomogeneous_layer_cycle_interval"]) == (
        "qwen3-next-80b-a3b", "qwen3_next", 4)
    assert (o["gdn_num_key_heads"], o["gdn_num_value_heads"], o["gdn_key_head_dim"], o["partial_rotary_factor"]) == (
        1, 2, 4, 0.25)
    assert (o["base_mlp_dim"], o["base_moe_mlp_dim"], o["shared_experts"], o["capacity_factor"]) == (8, 8, 1, -1.0)
    assert maxtext.notes(_cfg()) == []
    assert any("norm_topk_prob=false" in n for n in maxtext.notes(_cfg(norm_topk_prob=False)))
    # the released pattern: full attention every 4th of 8 layers -> two blocks of 4
    eight = _cfg(num_hidden_layers=8, layer_types=None, full_attention_interval=4)
    assert maxtext.layer_cycle(eight) == 4
    assert [(g.name, g.positions, g.inner) for g in maxtext.scan_groups(eight)] == [
        ("local_layers", (0, 1, 2), True), ("global_layer", (3,), False)]


@pytest.mark.parametrize(("over", "match"), [
    ({"layer_types": ["linear_attention", "full_attention"] * 2 + ["linear_attention"] * 2, "num_hidden_layers": 6},
     r"full-attention layers \[1, 3\] of 6 are not of that form"),
    ({"layer_types": ["full_attention"] + ["linear_attention"] * 3}, r"full-attention layers \[0\] of 4"),
    ({"layer_types": ["linear_attention"] * 4}, r"full-attention layers \[\] of 4"),
    ({"mlp_only_layers": [1]}, r"this model's layers \[1\] are dense"),
])
def test_what_maxtext_cannot_build_is_refused(over, match):
    """Layer kinds MaxText's qwen3_next block cannot derive from its cycle, and dense layers, are
    refused by the mapping (the export asks it before writing anything)."""
    with pytest.raises(ConfigError, match=match):
        maxtext.rules(_cfg(**over))
    with pytest.raises(ConfigError, match=match):
        maxtext.overrides(_cfg(**over)) if "mlp_only_layers" not in over else maxtext.rule_vars(_cfg(**over))


def _arr(*shape, start=0.0):
    return lazy.as_lazy(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + np.float32(start))


GROUPS = scan_groups.groups_of((("local_layers", (0, 1), True), ("global_layer", (2,), False)), 3)


def test_scan_groups_both_ways_and_their_refusals():
    """Per-layer names -> `local_layers` [d0, blocks, positions, ...] / `global_layer` [d0, blocks,
    ...] and back; a block missing a layer, an array of other blocks or positions than the config's
    (the file's word), an unknown group and a layer both scanned and unscanned refused in one line."""
    layers = {f"decoder.layers_{i}.norm.scale": _arr(4, start=10 * i) for i in range(6)}
    layers |= {f"decoder.layers_{i}.attention.A_log": _arr(2, 3, start=100 * i) for i in (0, 1, 3, 4)}
    layers |= {f"decoder.layers_{i}.attention.query": _arr(5, 2, start=1000 * i) for i in (2, 5)}
    disk = maxtext.to_disk(layers, True, 3, GROUPS)
    assert {k: v.shape for k, v in disk.items()} == {
        "decoder.layers.local_layers.norm.scale": (4, 2, 2), "decoder.layers.global_layer.norm.scale": (4, 2),
        "decoder.layers.local_layers.attention.A_log": (2, 2, 2, 3),
        "decoder.layers.global_layer.attention.query": (5, 2, 2)}
    a_log = disk["decoder.layers.local_layers.attention.A_log"].materialize()
    assert np.array_equal(a_log[:, 1, 0], layers["decoder.layers_3.attention.A_log"].materialize())
    back = maxtext.from_disk(disk, "t", 3, 6, GROUPS)
    assert sorted(back) == sorted(layers)
    for k, v in layers.items():
        assert np.array_equal(back[k].materialize(), v.materialize()), k
    assert maxtext.to_disk(layers, False, 3, GROUPS) == layers
    with pytest.raises(ConfigError, match="5 layers do not divide into them"):
        maxtext.to_disk({k: v for k, v in layers.items() if "_5." not in k}, True, 3, GROUPS)
    with pytest.raises(MappingError, match=r"A_log: the scanned group local_layers needs layers \[0, 1, 3, 4\], found \[0, 1, 3\]"):
        maxtext.to_disk({k: v for k, v in layers.items() if k != "decoder.layers_4.attention.A_log"}, True, 3, GROUPS)
    with pytest.raises(FormatError, match=r"local_layers\.norm\.scale: expected \(2, 2\) .* found shape \(4, 3, 2\)"):
        maxtext.from_disk({"decoder.layers.local_layers.norm.scale": _arr(4, 3, 2)}, "t", 3, 6, GROUPS)
    with pytest.raises(FormatError, match=r"global_layer\.q: expected \(2,\) .* found shape \(5,\)"):
        maxtext.from_disk({"decoder.layers.global_layer.q": _arr(5)}, "t", 3, 6, GROUPS)
    with pytest.raises(FormatError, match=r"expected decoder\.layers\.<group>\.\* with a group of"):
        maxtext.from_disk({"decoder.layers.layers_0.a": _arr(3, 2)}, "t", 3, 6, GROUPS)
    with pytest.raises(FormatError, match="both scanned"):
        maxtext.from_disk({"decoder.layers.global_layer.a": _arr(3, 2), "decoder.layers_2.a": _arr(3)}, "t", 3, 6, GROUPS)
