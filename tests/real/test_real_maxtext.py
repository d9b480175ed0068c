"""MaxText 0.2.5 against `export --to maxtext` and MaxText checkpoints as a source
(tests/real/generators/maxtext.py wrote `maxtext_llama3`, `maxtext_qwen3`, `maxtext_qwen3_moe`:
MaxText itself restored our export of the torchtitan case, ran it and stepped its optimizer; its own converter's output is the
reference layout, and `ckpt/` is the stepped train state MaxText's Checkpointer saved).

Here: our export's params equal MaxText's converter output bit for bit, its tree (names, nesting,
key types) is the one MaxText's own save has, its Adam moments are torchtitan's mapped like their
params (the query's rescaled: mu * sqrt(head_dim), nu * head_dim); MaxText's checkpoint read back
as a source gives HF names whose values are torchtitan's next step (relative 1e-5, all but the
query kernel: Adam is not invariant to MaxText's q' = q / sqrt(head_dim)), with MaxText's moments
and count; and `export --to hf` of it round-trips.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from cases import case_dir, ckpt, manifest, reference

import hybridckpt
from hybridckpt import jobs
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.formats.maxtext import layout as maxtext
from hybridckpt.formats.registry import detect
from hybridckpt.jobs.open import open_checkpoint

# case -> (the torchtitan case exported, query pre-scaled and q/k rows interleaved by MaxText)
CASES = {"maxtext_llama3": ("torchtitan_llama3", True), "maxtext_qwen3": ("torchtitan_qwen3", False),
         "maxtext_qwen3_moe": ("torchtitan_qwen3_moe", False)}
STEP = 3
QUERY = "decoder.layers.self_attention.query.kernel"
Q_PROJ = "self_attn.q_proj.weight"


def _config(case: str) -> str:
    return os.path.join(case_dir(case), "config.json")


@pytest.fixture(scope="module", params=sorted(CASES))
def export(request, tmp_path_factory):
    """(case, our `export --to maxtext --optimizer` of its torchtitan checkpoint: the items folder)."""
    case = request.param
    source = CASES[case][0]
    out = tmp_path_factory.mktemp("maxtext") / "out"
    jobs.export_checkpoint(ckpt(source), out, to="maxtext", optimizer=True, config=_config(source))
    return case, str(out / str(STEP) / maxtext.ITEM)


def _read(item_dir: str) -> dict[str, np.ndarray]:
    return {k: v.materialize() for k, v in item_arrays(item_dir).items()}


def _tree(item_dir: str) -> dict[str, tuple]:
    """Leaf path -> (key types, value type) from the item's `_METADATA`."""
    with open(os.path.join(item_dir, "_METADATA")) as f:
        meta = json.load(f)["tree_metadata"]
    return {".".join(k["key"] for k in e["key_metadata"]): (tuple(k["key_type"] for k in e["key_metadata"]),
                                                           e["value_metadata"]["value_type"])
            for e in meta.values()}


def test_params_equal_maxtexts_converter_bit_for_bit(export):
    case, items = export
    ours = _read(items)
    ref = reference(case)
    conv = {k[len("converter/"):]: v for k, v in ref.items() if k.startswith("converter/")}
    params = {k[len(maxtext.PARAMS):]: v for k, v in ours.items() if k.startswith(maxtext.PARAMS)}
    assert sorted(params) == sorted(conv)
    for k, v in conv.items():
        assert params[k].dtype == v.dtype and params[k].shape == v.shape, k
        assert np.array_equal(params[k], v), k
    if CASES[case][1]:  # the pre-scaling matters: without it the query kernel is not MaxText's
        q = params[QUERY] * np.float32(math.sqrt(8))
        assert not np.allclose(q, conv[QUERY], rtol=1e-3)


def test_tree_is_the_one_maxtext_saves(export):
    """Names, nesting (opt_state a list: [ScaleByAdamState, None, ScaleByScheduleState]) and key
    types as MaxText's own Checkpointer wrote them (its save holds no nnx_aux RNG state here)."""
    case, items = export
    ours, theirs = _tree(items), _tree(ckpt(case, "4", maxtext.ITEM))
    assert {k: v[0] for k, v in ours.items()} == {k: v[0] for k, v in theirs.items()}
    assert ours["opt_state.1"][1] == theirs["opt_state.1"][1] == "None"


def test_moments_are_torchtitans_mapped_like_their_params(export):
    """mu and nu bit for bit torchtitan's moments in MaxText's layout; Llama's query rescaled."""
    case, items = export
    source, prescaled = CASES[case]
    ours = _read(items)
    ref = reference(source)
    cfg = json.load(open(_config(source)))
    h, hd = cfg["num_attention_heads"], cfg["head_dim"]
    for slot, prefix, factor in (("exp_avg", maxtext.MU, np.float32(math.sqrt(hd))),
                                 ("exp_avg_sq", maxtext.NU, np.float32(hd))):
        for layer in range(cfg["num_hidden_layers"]):
            hf = ref[f"{slot}/model.layers.{layer}.{Q_PROJ}"]  # [heads*hd, embed], half-split rows
            if prescaled:  # MaxText's llama3.1 RoPE order, and q' = q / sqrt(hd)
                hf = hf.reshape(h, 2, hd // 2, -1).transpose(0, 2, 1, 3).reshape(h * hd, -1)
                want = (hf.T.reshape(-1, h, hd).astype(np.float32) * factor).astype(np.float32)
            else:
                want = hf.T.reshape(-1, h, hd)
            assert np.array_equal(ours[prefix + QUERY][:, layer], want), (slot, layer)
            if "num_experts" in cfg:  # MoE: experts [experts, layers, in, out], router [embed, layers, experts]
                for e in range(cfg["num_experts"]):
                    down = ref[f"{slot}/model.layers.{layer}.mlp.experts.{e}.down_proj.weight"]
                    assert np.array_equal(ours[prefix + "decoder.layers.moe_block.wo"][e, layer], down.T), (slot, e)
                router = ref[f"{slot}/model.layers.{layer}.mlp.gate.weight"]
                assert np.array_equal(ours[prefix + "decoder.layers.moe_block.gate.kernel"][:, layer], router.T)
                continue
            down = ref[f"{slot}/model.layers.{layer}.mlp.down_proj.weight"]
            assert np.array_equal(ours[prefix + "decoder.layers.mlp.wo.kernel"][:, layer], down.T)
        assert np.array_equal(ours[prefix + "token_embedder.embedding"], ref[f"{slot}/model.embed_tokens.weight"])
    assert int(ours[maxtext.ADAM_COUNT]) == int(ours[maxtext.SCHEDULE_COUNT]) == int(ours[maxtext.STEP]) == STEP


@pytest.mark.parametrize("case", sorted(CASES))
def test_maxtexts_checkpoint_as_a_source_is_torchtitans_next_step(case):
    """MaxText's stepped state read back: HF names, params = torchtitan's next step (rel 1e-5)
    on every tensor but Llama's q_proj, whose step MaxText's Adam takes differently (and that is
    seen); Qwen3, whose query MaxText stores as HF's, on every tensor."""
    source, prescaled = CASES[case]
    path = ckpt(case)
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_config(source))
    assert opened.format == maxtext.NAME
    named = opened.named
    ref = reference(source)
    nxt = {k[5:]: v for k, v in ref.items() if k.startswith("next/")}
    if json.load(open(_config(source)))["tie_word_embeddings"]:
        nxt.pop("lm_head.weight", None)  # a tied head is the embedding
    assert sorted(named.params) == sorted(nxt)
    worst, query = 0.0, 0.0
    for k, want in nxt.items():
        got = named.params[k].materialize()
        rel = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        if k.endswith(Q_PROJ) and prescaled:
            query = max(query, rel)
        else:
            worst = max(worst, rel)
    assert worst < 1e-5
    if prescaled:
        assert query > 1e-3  # Adam is not invariant to the query's rescaling
    # the stored params before the step are not the next step: the comparison can fail
    before = {k[6:]: v for k, v in ref.items() if k.startswith("param/")}
    moved = max(float(np.max(np.abs(before[k] - nxt[k])) / np.max(np.abs(nxt[k]))) for k in nxt)
    assert moved > 100 * 1e-5
    assert named.step == STEP + 1
    assert sorted(named.slots) == ["exp_avg", "exp_avg_sq"]
    assert sorted(named.slots["exp_avg"]) == sorted(nxt)


@pytest.mark.parametrize("case", sorted(CASES))
def test_maxtext_round_trip_through_hf(case, tmp_path):
    """MaxText -> HF folder (params and moments) -> MaxText: our export of the HF folder gives
    MaxText's arrays back (Llama's query to float32 rounding of x * sqrt(d) / sqrt(d))."""
    hf = tmp_path / "hf"
    jobs.export_checkpoint(ckpt(case), hf, to="hf", optimizer=True, config=_config(CASES[case][0]))
    back = tmp_path / "back"
    jobs.export_checkpoint(hf, back, to="maxtext", optimizer=True)
    theirs = _read(ckpt(case, "4", maxtext.ITEM))
    ours = _read(str(back / "4" / maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        if QUERY in k:
            np.testing.assert_allclose(ours[k], v, rtol=2e-7, atol=0)
        else:
            assert np.array_equal(ours[k], v), k


@pytest.mark.parametrize("case", sorted(CASES))
def test_manifest_records_maxtexts_own_checks(case):
    notes = " ".join(manifest(case)["notes"])
    assert "bit for bit" in notes and "negative control" in notes
    assert manifest(case)["versions"]["maxtext"] == "0.2.5"


def test_a_maxtext_source_needs_a_config_for_the_model_and_a_family_without_a_mapping_is_refused(tmp_path):
    from hybridckpt import models
    from hybridckpt.errors import ConfigError

    # without one, its tensors under MaxText's names (inspect lists them, as DCP's; issue 37)
    opened = open_checkpoint(ckpt("maxtext_llama3"))
    assert opened.config is None and "decoder.layers.mlp.wi_0.kernel" in opened.named.params
    with pytest.raises(ConfigError, match="carries no model config; logits needs one"):
        hybridckpt.logits(ckpt("maxtext_llama3"), [1, 2])
    gpt2 = models.config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 8,
                                  "n_head": 2, "n_layer": 1, "vocab_size": 16, "n_positions": 8})
    with pytest.raises(ConfigError, match="no mapping for family 'gpt2'"):
        maxtext.rules(gpt2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_maxtext_through_our_store_and_back_bit_for_bit(case, tmp_path):
    """import MaxText's checkpoint into our store (on a mesh), export it --to maxtext: every array
    MaxText wrote (params, mu, nu, counts, step) comes back bit for bit (Llama's query kernel and
    its moments to float32 rounding of the rescaling there and back)."""
    import jax

    store = tmp_path / "store"
    mesh = "fsdp=2" if jax.device_count() >= 2 else "dp=1"
    jobs.import_checkpoint(ckpt(case), store, mesh=mesh, config=_config(CASES[case][0]))
    back = tmp_path / "back"
    jobs.export_checkpoint(store, back, to="maxtext", optimizer=True)
    theirs = _read(ckpt(case, "4", maxtext.ITEM))
    ours = _read(str(back / "4" / maxtext.ITEM))
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype, k
        if QUERY in k and CASES[case][1]:  # float32 x * sqrt(d) then * (1 / sqrt(d)): within an ulp
            np.testing.assert_allclose(ours[k], v, rtol=2e-7, atol=0)
        else:
            assert np.array_equal(ours[k], v), k


def _mistral_config(tmp_path) -> str:
    """mistral_swa's HF config (its manifest's `hf_config`) as a config.json: a MaxText source needs one."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**manifest("mistral_swa")["hf_config"], "architectures": ["MistralForCausalLM"],
                                "model_type": "mistral"}))
    return str(path)


def test_maxtexts_mistral_weights_read_back_as_the_mistral_source(tmp_path):
    """`maxtext_mistral`: MaxText restored our weights-only export of Mistral's reference checkpoint
    into its `mistral` block, ran it, and saved the params as its converters save weights
    (opt_state {}, step 0). Read back: HF names and the Mistral reference weights (q_proj to the
    float32 rounding of q / sqrt(d) * sqrt(d)), no optimizer state, the dropped window noted; our
    export of the source is MaxText's saved params bit for bit."""
    path = ckpt("maxtext_mistral")
    assert detect(path) == maxtext.NAME
    opened = open_checkpoint(path, config=_mistral_config(tmp_path))
    named = opened.named
    want = {k: v for k, v in reference("mistral_swa").items() if k.startswith(("model.", "lm_head."))}
    assert sorted(named.params) == sorted(want)
    for k, v in want.items():
        got = named.params[k].materialize()
        if k.endswith(Q_PROJ):
            np.testing.assert_allclose(got, v, rtol=2e-7, atol=0)
        else:
            assert got.dtype == v.dtype and np.array_equal(got, v), k
    assert named.step == 0 and not named.slots
    assert any("attends globally (no sliding window)" in n for n in opened.notes)
    out = tmp_path / "ours"
    jobs.export_checkpoint(ckpt("mistral_swa"), out, to="maxtext")
    ours, theirs = _read(str(out / "0" / maxtext.ITEM)), _read(ckpt("maxtext_mistral", "0", maxtext.ITEM))
    # MaxText's weights save stores `step` as a plain int (Orbax "scalar"); the step read is the folder's
    theirs = {k: v for k, v in theirs.items() if k.startswith(maxtext.PARAMS)}
    assert sorted(ours) == sorted(theirs) + [maxtext.STEP]
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k


def test_maxtexts_mistral_forward_is_hfs_without_the_window():
    """MaxText's mistral forward of our export (recorded by the generator) is HF Mistral's without a
    sliding window (rel 1e-5), and not the windowed source model's: MaxText drops the window."""
    ref = reference("maxtext_mistral")
    mx, glob, win = ref["logits_maxtext"], ref["logits_hf_global"], ref["logits_hf_window"]
    assert float(np.max(np.abs(mx - glob)) / np.max(np.abs(glob))) < 1e-5
    assert float(np.max(np.abs(mx - win)) / np.max(np.abs(win))) > 1e-2
    mistral_inference = reference("mistral_swa")["logits"]  # the source tool's own (windowed) logits
    assert float(np.max(np.abs(win - mistral_inference)) / np.max(np.abs(mistral_inference))) < 1e-5
    assert manifest("maxtext_mistral")["versions"]["maxtext"] == "0.2.5"
