"""MaxText 0.2.5 runs a weights-only export of Qwen3-Next: our `export --to maxtext` of the
transformers-written case `hf524_qwen3_next` (4 layers: gated delta net 0-2, gated full attention
3; 4 experts top 2 plus the sigmoid-gated shared expert; partial RoPE 0.25; bf16) in MaxText's
`qwen3_next` decoder block (model `qwen3-next-80b-a3b` resized by the export's
`maxtext_overrides.json`). A part of `maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set
to the maxtext generator: `maxtext_setup`, `flat_params`, `nested`, `tools`, `SOURCES`; `steps`
to `_maxtext_restore.py`).

    python tests/real/make.py maxtext -- --case maxtext_qwen3_next

Steps: the export, scanned (MaxText scans Qwen3-Next in blocks of
`inhomogeneous_layer_cycle_interval` layers: `decoder.layers.local_layers` / `global_layer`) and
`--no-scan-layers`; MaxText's `setup_training_state` with `load_parameters_path` restores each (its
params equal to ours bit for bit, fp32 of our bf16, the unscanned ones per layer); its forward (fp32,
dot_product, the dense-matmul MoE path) against transformers' Qwen3NextForCausalLM (fp32, its torch
delta-rule kernels) of the same weights; MaxText's `save_checkpoint` of the restored params, as its
converters save weights, is the case's `ckpt/`.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)
steps = None  # _maxtext_restore.py, the weights cases' shared steps (set likewise)

SOURCE_CASE = "hf524_qwen3_next"
MODEL_NAME = "qwen3-next-80b-a3b"
TOLERANCE = 1e-4  # max |MaxText - HF| / max |HF| of the fp32 forwards (chunked vs torch delta rule)
HOST_QWEN3_NEXT = r"""
import sys, numpy as np, torch, transformers
ckpt, out = sys.argv[1], sys.argv[2]
tokens = torch.from_numpy(np.load(sys.argv[3]).astype(np.int64))
model = transformers.Qwen3NextForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
with torch.no_grad():
    np.save(out, model(tokens).logits.float().numpy())
"""


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    from safetensors.numpy import load_file

    source = gen.SOURCES / SOURCE_CASE
    ref = load_file(str(source / "reference.safetensors"))
    work, ours, ours_unscanned, overrides = steps.export_both(source, host_python)
    tokens_path, logits_path = os.path.join(work, "tokens.npy"), os.path.join(work, "hf_logits.npy")
    np.save(tokens_path, ref["tokens"])
    subprocess.run([host_python, "-c", HOST_QWEN3_NEXT, str(source / "ckpt"), logits_path, tokens_path], check=True)
    hf = np.load(logits_path)
    assert np.allclose(hf, ref["logits"], rtol=0, atol=1e-5), steps.rel(hf, ref["logits"])
    tokens = ref["tokens"].astype(np.int32)

    config, params, logits, logits_unscanned, rel, rel_unscanned = steps.scanned_and_unscanned(
        MODEL_NAME, "qwen3_next", ours, ours_unscanned, tokens, hf, TOLERANCE, "decoder.layers_3.")

    case = steps.save_weights(out, CASE, params, config)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf": hf, "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=steps.DISTS_HF,
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides,
        references={
            "logits_hf": f"transformers Qwen3NextForCausalLM (eager, fp32 of the bf16 weights) of {SOURCE_CASE}'s "
                         "checkpoint (its recorded logits, to 1e-5)",
            "logits_maxtext": "MaxText's forward (decoder_block qwen3_next, fp32, dot_product, sparse_matmul=False) of "
                              "our scanned export restored by load_parameters_path",
            "logits_maxtext_unscanned": "the same of our --no-scan-layers export with scan_layers=False",
            "tokens": f"{SOURCE_CASE}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored from our scanned export, as its converters "
                     "save weights (TrainState step 0, opt_state {})",
        },
        notes=[
            f"our `export --to maxtext` of {SOURCE_CASE} (transformers 5.24's save_pretrained, bf16) restored by "
            f"MaxText's load_parameters_path into its qwen3_next decoder block (model {MODEL_NAME} resized by the "
            "export's maxtext_overrides.json), scanned (decoder.layers.local_layers / global_layer, blocks of "
            f"{overrides['overrides']['inhomogeneous_layer_cycle_interval']} layers) and unscanned: params bit for bit "
            "ours (cast to MaxText's fp32 weights)",
            f"forward vs HF logits: max rel {rel:.2e} scanned, {rel_unscanned:.2e} unscanned (tolerance {TOLERANCE})",
        ],
    )
