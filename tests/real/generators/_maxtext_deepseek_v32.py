"""MaxText 0.2.5 runs a weights-only export of DeepSeek V3.2: our `export --to maxtext` of the
transformers-written case `hf524_deepseek_v32` (4 layers: dense 0, 1 and MoE 2, 3 with a shared
expert, 4 experts in 2 groups, the router's score-correction bias; MLA with q/kv LoRA; the
lightning indexer, 4 heads keeping the top 4 keys; YaRN factor 4) in MaxText's `deepseek` decoder
block (model `deepseek3.2-671b` resized by the export's `maxtext_overrides.json`). A part of
`maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set to the maxtext generator:
`maxtext_setup`, `flat_params`, `nested`, `tools`, `SOURCES`; `steps` to `_maxtext_restore.py`).

    python tests/real/make.py maxtext -- --case maxtext_deepseek_v32

Steps: the export, scanned (`decoder.dense_layers` / `decoder.moe_layers`) and `--no-scan-layers`;
MaxText's `setup_training_state` with `load_parameters_path` restores each (its params, and the
router bias it keeps as a `MoEBiasVar`, equal to ours); its forward (fp32, dot_product, the
dense-matmul MoE path and the default sparse one) against the source case's recorded
transformers logits; MaxText's `save_checkpoint` of the restored params, the bias under `params`
where its converter puts it (param_mapping.py `...MoeBlock_0-gate-bias`), is the case's `ckpt/`,
restored again by MaxText to the same logits.
"""

from __future__ import annotations

import json
import os

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)
steps = None  # _maxtext_restore.py, the weights cases' shared steps (set likewise)

SOURCE_CASE = "hf524_deepseek_v32"
MODEL_NAME = "deepseek3.2-671b"
BIAS = "decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"
TOL = 1e-5  # max |diff| / max |logits|, fp32 on both sides


def _bias(module, scanned: bool) -> dict[str, np.ndarray]:
    """The router biases MaxText holds (MoEBiasVar), under their param paths."""
    from flax import nnx
    from maxtext.layers import moe

    flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(module, moe.MoEBiasVar)))
    out = {".".join(str(k) for k in path[1:]): np.asarray(v) for path, v in flat.items()}
    assert out and all(k.endswith("MoeBlock_0.gate.bias") for k in out), sorted(out)
    assert (BIAS in out) == scanned, sorted(out)
    return out


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    from safetensors import safe_open

    source = gen.SOURCES / SOURCE_CASE
    with safe_open(str(source / "reference.safetensors"), "np") as f:
        ref = {k: f.get_tensor(k) for k in ("tokens", "logits")}
    _, ours, ours_unscanned, overrides = steps.export_both(source, host_python)
    assert overrides["notes"] == [], overrides["notes"]
    tokens = ref["tokens"].astype(np.int32)

    def run(path: str, extra: list[str], scanned: bool = True, item: str | None = None):
        config, module, params, logits = steps.restore_run(MODEL_NAME, "deepseek", path, tokens, extra, item)
        return config, {**params, **_bias(module, scanned)}, logits

    config, params, logits = run(ours, ["sparse_matmul=False"])
    rel = steps.rel(logits, ref["logits"])
    assert rel < TOL, rel
    # MaxText restores into weight_dtype float32: exact values
    steps.assert_same(steps.stored_params(ours), params)
    assert float(np.max(np.abs(params[BIAS]))) > 0  # restored, not MaxText's zero initialiser

    _, params_unscanned, logits_unscanned = run(ours_unscanned, ["scan_layers=False", "sparse_matmul=False"], False)
    assert any(k.startswith("decoder.moe_layers_1.") for k in params_unscanned), sorted(params_unscanned)[:5]
    steps.assert_same(steps.stored_params(ours_unscanned), params_unscanned)
    rel_unscanned = steps.rel(logits_unscanned, ref["logits"])
    assert rel_unscanned < TOL, rel_unscanned

    # MaxText's default MoE path (sparse_matmul, megablox's grouped matmul interpreted on CPU)
    _, _, logits_sparse = run(ours, ["sparse_matmul=True", "megablox=True"])
    rel_sparse = steps.rel(logits_sparse, ref["logits"])
    assert rel_sparse < TOL, rel_sparse

    case = steps.save_weights(out, CASE, params, config)
    # MaxText restores its own save (the bias looked up under params) to the same logits
    _, params_back, logits_back = run(ours, ["sparse_matmul=False"], item=os.path.join(case, "ckpt", "0", "items"))
    steps.assert_same(params, params_back)
    assert np.array_equal(logits_back, logits)

    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf": ref["logits"], "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned,
                                     "logits_maxtext_sparse": logits_sparse})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides,
        references={
            "logits_hf": f"{SOURCE_CASE}'s recorded logits (transformers 5.24 DeepseekV32ForCausalLM, fp32)",
            "logits_maxtext": "MaxText's forward (decoder_block deepseek, fp32, dot_product, sparse_matmul=False) of "
                              "our scanned export restored by load_parameters_path",
            "logits_maxtext_unscanned": "the same of our --no-scan-layers export with scan_layers=False",
            "logits_maxtext_sparse": "the scanned export on MaxText's default MoE path (sparse_matmul, megablox)",
            "tokens": f"{SOURCE_CASE}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored from our scanned export (fp32: its "
                     "weight_dtype), as its converters save weights (TrainState step 0, opt_state {}), the router "
                     "bias (a MoEBiasVar) under params as its converter stores it; MaxText restores it to "
                     "logits_maxtext bit for bit",
        },
        notes=[
            f"our `export --to maxtext` of {SOURCE_CASE} (transformers 5.24's save_pretrained, bf16) restored by "
            f"MaxText's load_parameters_path into its deepseek decoder block (model {MODEL_NAME} resized by the "
            "export's maxtext_overrides.json), scanned (dense_layers / moe_layers) and unscanned: params and the "
            "router bias exactly ours (cast to MaxText's fp32 weight_dtype)",
            f"forward vs transformers' logits: max rel {rel:.2e} (dense-matmul MoE), {rel_unscanned:.2e} (unscanned), "
            f"{rel_sparse:.2e} (sparse/megablox); tolerance {TOL} (fp32 both sides): at that agreement the indexer's "
            "top-k keys and the routing's experts were the same on both sides (no tie flipped)",
        ],
    )
    print(json.dumps({"case": CASE, "rel": rel, "rel_unscanned": rel_unscanned, "rel_sparse": rel_sparse}))
