"""MaxText 0.2.5 runs a weights-only export of GPT-OSS: our `export --to maxtext` of the
transformers-written MXFP4 case `gpt_oss_mxfp4` (2 layers: sliding window 4, then full attention;
biases on q/k/v/o, attention sinks; 4 experts top 4 with router and expert biases, the clamped
SwiGLU; YaRN; the experts dequantized to bf16 on import, exactly) in MaxText's `gpt_oss` decoder
block (model `gpt-oss-20b` resized by the export's `maxtext_overrides.json`). A part of
`maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set to the maxtext generator).

    python tests/real/make.py maxtext -- --case maxtext_gpt_oss

Steps: the export, scanned (MaxText scans GPT-OSS in blocks of 2 layers: `decoder.layers.layers_0`
sliding, `layers_1` full) and `--no-scan-layers`; MaxText's `setup_training_state` with
`load_parameters_path` restores each (its params equal to ours bit for bit, fp32 of our bf16);
its forward (fp32, dot_product, the dense-matmul MoE path) against the case's recorded
transformers logits (GptOssForCausalLM, fp32 eager, of the dequantized weights); MaxText's
`save_checkpoint` of the restored params is the case's `ckpt/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)

SOURCE_CASE = "gpt_oss_mxfp4"
MODEL_NAME = "gpt-oss-20b"
TOLERANCE = 1e-4  # max |MaxText - HF| / max |HF| of the fp32 forwards


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _overrides(path: str, extra: list[str]) -> list[str]:
    doc = json.load(open(os.path.join(path, "maxtext_overrides.json")))
    return [f"{k}={v}" for k, v in doc["overrides"].items()] + extra


def _ours_flat(path):
    """Our export as numpy (written on 8 simulated devices: no shardings)."""
    import jax
    import orbax.checkpoint as ocp

    item = os.path.join(path, "0", "items")
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(item)
    meta = getattr(meta, "item_metadata", meta)
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    return gen.flat_params(ckptr.restore(item, restore_args=args)["params"]["params"])


def generate(CASE: str, out: str, host_python: str) -> None:  # noqa: N803
    from flax.training import train_state
    from maxtext.common import checkpointing, train_state_nnx
    from safetensors.numpy import load_file

    source = gen.SOURCES / SOURCE_CASE
    ref = load_file(str(source / "reference.safetensors"))
    work = tempfile.mkdtemp(prefix="mx-gen-")
    ours, ours_unscanned = os.path.join(work, "ours"), os.path.join(work, "ours_unscanned")
    host = [host_python, "-m", "hybridckpt.cli", "export", str(source / "ckpt")]
    subprocess.run([*host, ours, "--to", "maxtext"], check=True)
    subprocess.run([*host, ours_unscanned, "--to", "maxtext", "--no-scan-layers"], check=True)
    overrides = json.load(open(os.path.join(ours, "maxtext_overrides.json")))
    hf = ref["logits"]

    tokens = ref["tokens"].astype(np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

    def run(path: str, extra: list[str]):
        config, module, state = gen.maxtext_setup(None, MODEL_NAME, _overrides(path, [f"load_parameters_path={path}/0/items",
                                                                                       *extra]))
        assert config.decoder_block.value == "gpt_oss", config.decoder_block
        logits = np.asarray(module.model(tokens, positions, enable_dropout=False))
        return config, gen.flat_params(train_state_nnx.to_checkpoint_dict(state)["params"]["params"]), logits

    config, params, logits = run(ours, ["sparse_matmul=False"])
    rel = _rel(logits, hf)
    print("maxtext vs hf", rel)
    assert rel < TOLERANCE, rel

    mine = _ours_flat(ours)
    assert sorted(mine) == sorted(params), sorted(set(mine) ^ set(params))
    for k, v in mine.items():
        assert np.array_equal(params[k], v.astype(params[k].dtype)), k

    _, params_unscanned, logits_unscanned = run(ours_unscanned, ["scan_layers=False", "sparse_matmul=False"])
    assert any(k.startswith("decoder.layers_1.") for k in params_unscanned), sorted(params_unscanned)[:5]
    mine_unscanned = _ours_flat(ours_unscanned)
    assert sorted(mine_unscanned) == sorted(params_unscanned)
    for k, v in mine_unscanned.items():
        assert np.array_equal(params_unscanned[k], v.astype(params_unscanned[k].dtype)), k
    rel_unscanned = _rel(logits_unscanned, hf)
    assert rel_unscanned < TOLERANCE, rel_unscanned

    saved = train_state.TrainState(step=0, apply_fn=None, params={"params": gen.nested(params)}, tx=None, opt_state={})
    case = gen.tools.fresh_case(out, CASE)
    mngr = checkpointing.create_orbax_checkpoint_manager(os.path.join(case, "ckpt"), True, False, 1,
                                                         use_ocdbt=False, use_zarr3=False)
    checkpointing.save_checkpoint(mngr, 0, saved, config=config, force=True)
    checkpointing.wait_until_finished(mngr)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf": hf, "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=["maxtext", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "numpy"],
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
