"""MaxText 0.2.5 runs a weights-only export of GPT-OSS: our `export --to maxtext` of the
transformers-written MXFP4 case `gpt_oss_mxfp4` (2 layers: sliding window 4, then full attention;
biases on q/k/v/o, attention sinks; 4 experts top 4 with router and expert biases, the clamped
SwiGLU; YaRN; the experts dequantized to bf16 on import, exactly) in MaxText's `gpt_oss` decoder
block (model `gpt-oss-20b` resized by the export's `maxtext_overrides.json`). A part of
`maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set to the maxtext generator,
`steps` to `_maxtext_restore.py`).

    python tests/real/make.py maxtext -- --case maxtext_gpt_oss

Steps: the export, scanned (MaxText scans GPT-OSS in blocks of 2 layers: `decoder.layers.layers_0`
sliding, `layers_1` full) and `--no-scan-layers`; MaxText's `setup_training_state` with
`load_parameters_path` restores each (its params equal to ours bit for bit, fp32 of our bf16);
its forward (fp32, dot_product, the dense-matmul MoE path) against the case's recorded
transformers logits (GptOssForCausalLM, fp32 eager, of the dequantized weights); MaxText's
`save_checkpoint` of the restored params is the case's `ckpt/`.
"""

from __future__ import annotations

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)
steps = None  # _maxtext_restore.py, the weights cases' shared steps (set likewise)

SOURCE_CASE = "gpt_oss_mxfp4"
MODEL_NAME = "gpt-oss-20b"
TOLERANCE = 1e-4  # max |MaxText - HF| / max |HF| of the fp32 forwards


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    from safetensors.numpy import load_file

    source = gen.SOURCES / SOURCE_CASE
    ref = load_file(str(source / "reference.safetensors"))
    _, ours, ours_unscanned, overrides = steps.export_both(source, host_python)
    hf = ref["logits"]
    tokens = ref["tokens"].astype(np.int32)

    config, params, logits, logits_unscanned, rel, rel_unscanned = steps.scanned_and_unscanned(
        MODEL_NAME, "gpt_oss", ours, ours_unscanned, tokens, hf, TOLERANCE, "decoder.layers_1.")

    case = steps.save_weights(out, CASE, params, config)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf": hf, "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS_HF,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides,
        references={
            "logits_hf": f"{SOURCE_CASE}'s recorded logits: transformers GptOssForCausalLM (eager, fp32) of its "
                         "checkpoint, MXFP4 dequantized",
            "logits_maxtext": "MaxText's forward (decoder_block gpt_oss, fp32, dot_product, sparse_matmul=False) of "
                              "our scanned export restored by load_parameters_path",
            "logits_maxtext_unscanned": "the same of our --no-scan-layers export with scan_layers=False",
            "tokens": f"{SOURCE_CASE}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored from our scanned export, as its converters "
                     "save weights (TrainState step 0, opt_state {})",
        },
        notes=[
            f"our `export --to maxtext` of {SOURCE_CASE} (MXFP4 experts dequantized to bf16, exactly) restored by "
            f"MaxText's load_parameters_path into its gpt_oss decoder block (model {MODEL_NAME} resized by the "
            "export's maxtext_overrides.json), scanned (decoder.layers.layers_0 / layers_1, blocks of "
            f"{overrides['overrides']['inhomogeneous_layer_cycle_interval']} layers) and unscanned: params bit for bit "
            "ours (cast to MaxText's fp32 weights)",
            f"forward vs HF logits: max rel {rel:.2e} scanned, {rel_unscanned:.2e} unscanned (tolerance {TOLERANCE})",
        ],
    )
