"""MaxText 0.2.5's Llama 4 against `export --to maxtext` (tests/real/generators/_maxtext_llama4.py
wrote `maxtext_llama4`: MaxText restored our weights-only export of transformers' `hf524_llama4`
into its `llama4` decoder block, scanned and unscanned, ran its forward, and saved the params it
restored as its converters save weights).

Here: MaxText's save read back as a source is hf524_llama4's weights bit for bit (Llama 4 has no
value op in MaxText) and runs, in our model with the constants MaxText hard-codes, to MaxText's own
logits; our export is MaxText's save bit for bit (scanned in blocks of
`inhomogeneous_layer_cycle_interval` layers: `decoder.layers.layers_<p>`); MaxText's save imported
onto a mesh and exported again is MaxText's save bit for bit; the unscanned export reads back; the
overrides, notes and refusals (layer kinds MaxText derives from intervals, top-k, the
multimodal wrapper, a scan block that does not divide the layers, hostile scanned names).
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

SOURCE, CASE, ADAMW = "hf524_llama4", "maxtext_llama4", "maxtext_llama4_adamw"
# what MaxText's llama4 block hard-codes (models/llama4.py, layers/embeddings.py)
MAXTEXT_CONSTANTS = {"attn_scale": 0.1, "floor_scale": 8192}


_config_dict = partial(config_dict, SOURCE)  # (**over) -> the source's config.json, keys changed
_config_file = partial(config_file, source=SOURCE)  # (tmp_path, **over) -> that written as a file


def _weights() -> dict[str, np.ndarray]:
    return {k: v for k, v in reference(SOURCE).items() if k not in ("logits", "tokens")}


def test_maxtexts_save_reads_back_as_the_transformers_weights(tmp_path):
    """MaxText's save (scanned, `decoder.layers.layers_<p>`) with the source's config.json: every HF
    tensor of hf524_llama4 bit for bit, the fused experts' gate_up_proj joined back from wi_0 / wi_1;
    no optimizer state; the constants MaxText hard-codes noted."""
    path = ckpt(CASE)
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_config_file(tmp_path))
    named = opened.named
    want = _weights()
    assert sorted(named.params) == sorted(want)
    for k, v in want.items():
        got = named.params[k].materialize()
        assert got.dtype == v.dtype and np.array_equal(got, v), k
    assert named.step == 0 and not named.slots
    assert any("temperature tuning hard-codes scale 0.1 and floor 8192" in n for n in opened.notes)
    assert any("original_max_position_embeddings=16" in n for n in opened.notes)


def test_a_config_of_other_layers_is_refused_reading_maxtexts_save(tmp_path):
    """MaxText's 4-layer save read with a 6-layer config: its blocks hold 2 layers where the config
    wants 3 (one line naming the array and both counts), not a silent partial model."""
    config = _config_file(tmp_path, num_hidden_layers=6, moe_layers=None, no_rope_layers=None, layer_types=None)
    with pytest.raises(FormatError, match=r"items: decoder\.layers\.layers_0\.\S+: expected a block position < 2 "
                                          r"holding 3 of the 6 layers on axis 1, found shape \(16, 2, "):
        assert not open_checkpoint(ckpt(CASE), config=config).named.params


def test_maxtexts_forward_is_transformers_with_maxtexts_constants():
    """The generator's record: MaxText's forward of our export (scanned, unscanned, sparse MoE
    path) is transformers' Llama4ForCausalLM of the same weights with MaxText's constants (rel
    1e-5), and far from the source model's own config (what the notes say)."""
    ref = reference(CASE)
    for key in ("logits_maxtext", "logits_maxtext_unscanned", "logits_maxtext_sparse"):
        assert rel(ref[key], ref["logits_hf_maxtext"]) < 1e-5, key
    assert rel(ref["logits_maxtext"], ref["logits_hf_source"]) > 1e-1
    assert np.allclose(ref["logits_hf_source"], reference(SOURCE)["logits"], rtol=0, atol=1e-5)
    assert np.array_equal(ref["tokens"], reference(SOURCE)["tokens"])
    assert manifest(CASE)["versions"]["maxtext"] == "0.2.5"


def test_our_model_runs_maxtexts_save_to_maxtexts_logits(tmp_path):
    """MaxText's save as a source, run by our Llama 4 with the constants MaxText hard-codes (RoPE
    original context 8192, temperature scale 0.1 / floor 8192): MaxText's own logits (rel 1e-5)."""
    rope = dict(_config_dict()["rope_parameters"], original_max_position_embeddings=8192)
    config = _config_file(tmp_path, rope_parameters=rope, **MAXTEXT_CONSTANTS)
    ref = reference(CASE)
    got = jobs.logits(ckpt(CASE), ref["tokens"], config=config)
    assert rel(got, ref["logits_maxtext"]) < 1e-5


def test_our_export_is_maxtexts_save_bit_for_bit(tmp_path):
    """`export --to maxtext` of transformers' checkpoint: MaxText's saved params, names and values
    bit for bit (MaxText's weights save stores `step` as a plain int: compared apart)."""
    out = tmp_path / "ours"
    jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext")
    ours, theirs = params(str(out / "0" / maxtext.ITEM)), params(ckpt(CASE, "0", maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    assert "params.params.decoder.layers.layers_1.Llama4MoEBlock_0.MoeBlock_0.wi_0" in ours
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k
    written = json.loads((out / "maxtext_overrides.json").read_text())
    assert written["overrides"] == manifest(CASE)["overrides"]["overrides"]  # what MaxText ran with


def test_imported_maxtext_save_exports_back_bit_for_bit(tmp_path):
    """MaxText's save imported onto a mesh (with the config) and exported to MaxText again: its
    params bit for bit; unscanned, one `decoder.layers_<i>` per layer, read back to the weights."""
    store = exported_back(tmp_path, CASE, _config_file(tmp_path))
    flat = tmp_path / "flat"
    jobs.export_checkpoint(store, flat, to="maxtext", options={"scan_layers": False})
    names = sorted(item_arrays(str(flat / "0" / maxtext.ITEM)))
    assert "params.params.decoder.layers_3.Llama4MoEBlock_0.MoeBlock_0.wo" in names
    assert "params.params.decoder.layers_2.mlp.wo.kernel" in names and not any(".layers.layers_" in n for n in names)
    named = open_checkpoint(str(flat), config=_config_file(tmp_path)).named
    for k, v in _weights().items():
        assert np.array_equal(named.params[k].materialize(), v), k


def test_maxtexts_adamw_step_reads_back_as_torchs_next_step(tmp_path):
    """`maxtext_llama4_adamw`: MaxText restored our `--optimizer` export of a torch FSDP2 AdamW run
    of this Llama 4 (params, mu, nu, counts bit for bit torch's), stepped it with its adamw and
    torch's next gradients, and saved the state. Read back: HF names, torch's step 4 (rel 1e-5),
    MaxText's moments under every param, step 4."""
    path = ckpt(ADAMW)
    assert detect(path) == maxtext.NAME
    named = open_checkpoint(path, config=_config_file(tmp_path)).named
    nxt = {k[5:]: v for k, v in reference(ADAMW).items() if k.startswith("next/")}
    assert sorted(named.params) == sorted(nxt) and named.step == 4
    assert all(sorted(named.slots[s]) == sorted(nxt) for s in ("exp_avg", "exp_avg_sq"))
    worst = max(rel(named.params[k].materialize(), v) for k, v in nxt.items())
    assert worst < 1e-5
    assert any(float(np.max(named.slots["exp_avg_sq"][k].materialize())) > 0 for k in nxt)
    assert manifest(ADAMW)["hf_config"] == _config_dict()


def test_maxtexts_adamw_state_imports_and_exports_back_bitwise(tmp_path):
    """MaxText's stepped Llama 4 train state imported onto a mesh and exported with `--optimizer`:
    every leaf MaxText wrote (params, mu, nu, counts, step) bit for bit, under its names."""
    import jax

    store = tmp_path / "store"
    mesh = "fsdp=2" if jax.device_count() >= 2 else "dp=1"
    jobs.import_checkpoint(ckpt(ADAMW), store, mesh=mesh, config=_config_file(tmp_path))
    back = tmp_path / "back"
    jobs.export_checkpoint(store, back, to="maxtext", optimizer=True)
    theirs = {k: v.materialize() for k, v in item_arrays(ckpt(ADAMW, "4", maxtext.ITEM)).items()}
    ours = {k: v.materialize() for k, v in item_arrays(str(back / "4" / maxtext.ITEM)).items()}
    assert sorted(ours) == sorted(theirs)
    assert "opt_state.0.nu.params.decoder.layers.layers_1.Llama4MoEBlock_0.MoeBlock_0.wi_1" in ours
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k


def _cfg(**over):
    return models.config_from_hf(_config_dict(**over))


def test_overrides_and_notes():
    o = maxtext.overrides(_cfg())
    assert (o["model_name"], o["decoder_block"], o["rope_type"]) == ("llama4-17b-16e", "llama4", "llama3.1")
    assert (o["interleave_moe_layer_step"], o["nope_layer_interval"], o["inhomogeneous_layer_cycle_interval"]) == (2, 2, 2)
    assert (o["base_mlp_dim"], o["base_moe_mlp_dim"], o["num_experts"], o["chunk_attn_window_size"]) == (24, 8, 4, 5)
    assert o["rope_use_scale"] is True and o["temperature_tuning"] is True and o["capacity_factor"] == -1.0
    rope = dict(_config_dict()["rope_parameters"], original_max_position_embeddings=8192)
    assert maxtext.notes(_cfg(rope_parameters=rope, **MAXTEXT_CONSTANTS)) == []
    # Maverick's pattern: MoE every 2nd layer, NoPE every 4th: scanned in blocks of 4
    mav = _cfg(num_hidden_layers=8, moe_layers=None, no_rope_layers=None, layer_types=None, no_rope_layer_interval=4)
    o = maxtext.overrides(mav)
    assert (o["interleave_moe_layer_step"], o["nope_layer_interval"], o["inhomogeneous_layer_cycle_interval"]) == (2, 4, 4)
    assert maxtext.layer_cycle(mav) == 4
    # every layer MoE (Scout): MaxText wants the dense width equal to the experts'
    scout = _cfg(moe_layers=None, interleave_moe_layer_step=1)
    assert maxtext.overrides(scout)["base_mlp_dim"] == 8 and maxtext.layer_cycle(scout) == 2
    # no chunk size: MaxText's RoPE layers still chunk, by the whole context (said)
    full = _cfg(attention_chunk_size=None, layer_types=None)
    assert maxtext.overrides(full)["chunk_attn_window_size"] == 64
    assert any("no attention_chunk_size" in n for n in maxtext.notes(full))


@pytest.mark.parametrize(("over", "match"), [
    ({"moe_layers": [1, 2]}, r"MoE layers \[1, 2\] of 4 are not of that form"),
    ({"moe_layers": [1]}, r"MoE layers \[1\] of 4 are not of that form"),
    ({"no_rope_layers": [0, 1, 1, 0], "layer_types": None}, r"NoPE layers \[0, 3\] of 4 are not of that form"),
    ({"num_experts_per_tok": 2}, "routes each token to one expert"),
    ({"layer_types": ["full_attention"] * 4}, "chunked attention to exactly the RoPE layers"),
])
def test_what_maxtext_cannot_build_is_refused_before_writing(tmp_path, over, match):
    with pytest.raises(ConfigError, match=match):
        maxtext.rules(_cfg(**over))
    if "moe_layers" in over:  # the checkpoint's own tensors say which layers are MoE: the config alone
        return
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        jobs.export_checkpoint(ckpt(SOURCE), out, to="maxtext", config=_config_file(tmp_path, **over))
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["config.json"]


def test_the_multimodal_wrapper_is_refused_naming_it(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"no mapping for family 'llama4_mm'"):
        jobs.export_checkpoint(ckpt("hf524_llama4_mm"), out, to="maxtext")
    assert not out.exists()


def _arr(*shape, start=0.0):
    return lazy.as_lazy(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + np.float32(start))


def test_cycle_layout_both_ways_and_its_refusals():
    """Per-layer names -> blocks of `cycle` layers on the scan axis and back; a layer count the
    block does not divide (MaxText would drop the remainder), a block missing a layer, a block
    position >= cycle and a layer both scanned and unscanned are refused in one line."""
    layers = {f"decoder.layers_{i}.a.kernel": _arr(3, 2, start=10 * i) for i in range(4)}
    layers |= {f"decoder.layers_{i}.moe.wo": _arr(5, 3, start=100 * i) for i in (1, 3)}
    disk = maxtext.to_disk(layers, True, 2)
    assert sorted(disk) == ["decoder.layers.layers_0.a.kernel", "decoder.layers.layers_1.a.kernel",
                            "decoder.layers.layers_1.moe.wo"]
    assert disk["decoder.layers.layers_1.moe.wo"].shape == (5, 2, 3)
    assert np.array_equal(disk["decoder.layers.layers_1.a.kernel"].materialize()[:, 1], layers["decoder.layers_3.a.kernel"].materialize())
    back = maxtext.from_disk(disk, "t", 2, 4)
    assert sorted(back) == sorted(layers)
    for k, v in layers.items():
        assert np.array_equal(back[k].materialize(), v.materialize()), k
    assert maxtext.to_disk(layers, False, 2) == layers  # unscanned: the names as they are
    with pytest.raises(ConfigError, match="4 layers do not divide into them"):
        maxtext.to_disk(layers, True, 3)
    with pytest.raises(MappingError, match=r"block position 1 needs layers \[1, 3\], found \[1\]"):
        maxtext.to_disk({k: v for k, v in layers.items() if k != "decoder.layers_3.moe.wo"}, True, 2)
    with pytest.raises(FormatError, match="expected a block position < 2"):
        maxtext.from_disk({"decoder.layers.layers_2.a.kernel": _arr(3, 2, 2)}, "t", 2, 4)
    # the scan axis is the file's word: more (or fewer) blocks than the config's layers are refused
    with pytest.raises(FormatError, match=r"holding 2 of the 4 layers on axis 1, found shape \(3, 3, 2\)"):
        maxtext.from_disk({"decoder.layers.layers_1.a.kernel": _arr(3, 3, 2)}, "t", 2, 4)
    with pytest.raises(FormatError, match="both scanned"):
        maxtext.from_disk({"decoder.layers.layers_0.a.kernel": _arr(3, 1, 2), "decoder.layers_0.a.kernel": _arr(3, 2)},
                          "t", 2, 2)
    with pytest.raises(FormatError, match=r"expected decoder\.layers\.layers_<p>"):
        maxtext.from_disk({"decoder.layers.a.kernel": _arr(3, 2, 2)}, "t", 2, 4)
