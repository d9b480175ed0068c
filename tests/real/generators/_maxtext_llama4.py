"""MaxText 0.2.5 runs a weights-only export of Llama 4: our `export --to maxtext` of the
transformers-written case `hf524_llama4` (4 layers: dense 0, 2 and MoE 1, 3; NoPE 1, 3 with
temperature tuning; chunked attention of 5 on the RoPE layers; L2 q/k norm; llama3 RoPE) in
MaxText's `llama4` decoder block (model `llama4-17b-16e` resized by the export's
`maxtext_overrides.json`). A part of `maxtext.py` (loaded by `_maxtext_weights_only.py`, `gen` set
to the maxtext generator: `maxtext_setup`, `flat_params`, `nested`, `tools`, `SOURCES`).

    python tests/real/make.py maxtext -- --case maxtext_llama4

Steps: the export, scanned (MaxText scans Llama 4 in blocks of `inhomogeneous_layer_cycle_interval`
layers: `decoder.layers.layers_<p>`) and `--no-scan-layers`; MaxText's `setup_training_state` with
`load_parameters_path` restores each (its params equal to ours bit for bit, the unscanned ones per
layer); its forward (fp32, dot_product, the dense-matmul MoE path and the default sparse one)
against transformers' Llama4ForCausalLM of the same weights with the constants MaxText
hard-codes (RoPE original context 8192, temperature scale 0.1 and floor 8192); MaxText's
`save_checkpoint` of the restored params, as its converters save weights, is the case's `ckpt/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)

SOURCE_CASE = "hf524_llama4"
MODEL_NAME = "llama4-17b-16e"
HOST_LLAMA4 = r"""
import json, sys, numpy as np, torch, transformers
ckpt, out = sys.argv[1], sys.argv[2]
tokens = torch.from_numpy(np.load(sys.argv[3]).astype(np.int64))
cfg = json.load(open(ckpt + "/config.json"))
variants = {
    "source": {},
    # what MaxText's llama4 block hard-codes: llama3.1 RoPE constants, temperature scale and floor
    "maxtext": {"rope_parameters": dict(cfg["rope_parameters"], original_max_position_embeddings=8192),
                "attn_scale": 0.1, "floor_scale": 8192},
}
res = {}
for name, change in variants.items():
    c = transformers.Llama4TextConfig(**{**cfg, **change})
    model = transformers.Llama4ForCausalLM.from_pretrained(ckpt, config=c, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    with torch.no_grad():
        res[name] = model(tokens).logits.float().numpy()
np.savez(out, **res)
"""


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _overrides(path: str, extra: list[str]) -> list[str]:
    doc = json.load(open(os.path.join(path, "maxtext_overrides.json")))
    return [f"{k}={v}" for k, v in doc["overrides"].items()] + extra


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
    tokens_path, logits_path = os.path.join(work, "tokens.npy"), os.path.join(work, "hf_logits.npz")
    np.save(tokens_path, ref["tokens"])
    subprocess.run([host_python, "-c", HOST_LLAMA4, str(source / "ckpt"), logits_path, tokens_path], check=True)
    hf = dict(np.load(logits_path))
    assert np.allclose(hf["source"], ref["logits"], rtol=0, atol=1e-5), _rel(hf["source"], ref["logits"])

    tokens = ref["tokens"].astype(np.int32)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)

    def run(path: str, extra: list[str]):
        config, module, state = gen.maxtext_setup(None, MODEL_NAME, _overrides(path, [f"load_parameters_path={path}/0/items",
                                                                                       *extra]))
        assert config.decoder_block.value == "llama4", config.decoder_block
        logits = np.asarray(module.model(tokens, positions, enable_dropout=False))
        return config, gen.flat_params(train_state_nnx.to_checkpoint_dict(state)["params"]["params"]), logits

    config, params, logits = run(ours, ["sparse_matmul=False"])
    rel = _rel(logits, hf["maxtext"])
    rel_source = _rel(logits, hf["source"])
    assert rel < 1e-5, rel
    assert rel_source > 1e-3, rel_source  # the hard-coded constants matter on this case

    import orbax.checkpoint as ocp

    def ours_flat(path):  # our export as numpy (it was written on 8 simulated devices: no shardings)
        import jax

        item = os.path.join(path, "0", "items")
        ckptr = ocp.PyTreeCheckpointer()
        meta = ckptr.metadata(item)
        meta = getattr(meta, "item_metadata", meta)
        args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        tree = ckptr.restore(item, restore_args=args)
        return gen.flat_params(tree["params"]["params"])

    mine = ours_flat(ours)
    assert sorted(mine) == sorted(params), sorted(set(mine) ^ set(params))
    for k, v in mine.items():
        assert params[k].dtype == v.dtype and np.array_equal(params[k], v), k

    _, params_unscanned, logits_unscanned = run(ours_unscanned, ["scan_layers=False", "sparse_matmul=False"])
    assert any(k.startswith("decoder.layers_3.") for k in params_unscanned), sorted(params_unscanned)[:5]
    mine_unscanned = ours_flat(ours_unscanned)
    assert sorted(mine_unscanned) == sorted(params_unscanned)
    for k, v in mine_unscanned.items():
        assert np.array_equal(params_unscanned[k], v), k
    assert np.allclose(logits_unscanned, logits, rtol=0, atol=1e-5 * np.max(np.abs(logits)))

    # MaxText's default MoE path (sparse_matmul, megablox's grouped matmul interpreted on CPU)
    _, _, logits_sparse = run(ours, ["sparse_matmul=True", "megablox=True"])
    rel_sparse = _rel(logits_sparse, hf["maxtext"])
    assert rel_sparse < 1e-5, rel_sparse

    saved = train_state.TrainState(step=0, apply_fn=None, params={"params": gen.nested(params)}, tx=None, opt_state={})
    case = gen.tools.fresh_case(out, CASE)
    mngr = checkpointing.create_orbax_checkpoint_manager(os.path.join(case, "ckpt"), True, False, 1,
                                                         use_ocdbt=False, use_zarr3=False)
    checkpointing.save_checkpoint(mngr, 0, saved, config=config, force=True)
    checkpointing.wait_until_finished(mngr)
    gen.tools.write_reference(case, {"tokens": ref["tokens"], "logits_hf_maxtext": hf["maxtext"],
                                     "logits_hf_source": hf["source"], "logits_maxtext": logits,
                                     "logits_maxtext_unscanned": logits_unscanned,
                                     "logits_maxtext_sparse": logits_sparse})
    gen.tools.record_manifest(
        case, tool="maxtext",
        dists=["maxtext", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "numpy"],
        command=f"python tests/real/make.py maxtext -- --case {CASE}",
        overrides=overrides,
        references={
            "logits_hf_maxtext": f"transformers Llama4ForCausalLM (eager, fp32) of {SOURCE_CASE}'s checkpoint with the "
                                 "constants MaxText's llama4 block hard-codes: rope_parameters original_max_position_"
                                 "embeddings 8192, attn_scale 0.1, floor_scale 8192",
            "logits_hf_source": f"the same with {SOURCE_CASE}'s own config (its recorded logits, to 1e-5)",
            "logits_maxtext": "MaxText's forward (decoder_block llama4, fp32, dot_product, sparse_matmul=False) of our "
                              "scanned export restored by load_parameters_path",
            "logits_maxtext_unscanned": "the same of our --no-scan-layers export with scan_layers=False",
            "logits_maxtext_sparse": "the scanned export on MaxText's default MoE path (sparse_matmul, megablox)",
            "tokens": f"{SOURCE_CASE}'s tokens",
            "ckpt/": "MaxText's save_checkpoint of the params it restored from our scanned export, as its converters "
                     "save weights (TrainState step 0, opt_state {})",
        },
        notes=[
            f"our `export --to maxtext` of {SOURCE_CASE} (transformers 5.24's save_pretrained, fp32) restored by "
            f"MaxText's load_parameters_path into its llama4 decoder block (model {MODEL_NAME} resized by the "
            "export's maxtext_overrides.json), scanned in blocks of inhomogeneous_layer_cycle_interval "
            f"{overrides['overrides']['inhomogeneous_layer_cycle_interval']} layers, and unscanned: params bit for bit ours",
            f"forward vs HF logits with MaxText's constants: max rel {rel:.2e} (dense-matmul MoE), {rel_sparse:.2e} "
            f"(sparse/megablox); vs the source model's own config: {rel_source:.2e} (MaxText hard-codes the Llama 3.1 "
            "RoPE scaling constants and the temperature tuning's scale 0.1 / floor 8192; the export's notes say so)",
            "no MaxText converter output as reference: to_maxtext has no llama4 mapping (param_mapping.py "
            "PARAM_MAPPING), and standalone_scripts/llama4_ckpt_unscanned.py imports torch, which has no wheel "
            "for this Python 3.12 venv here",
        ],
    )
    print(json.dumps({"case": CASE, "rel": rel, "rel_sparse": rel_sparse, "rel_source": rel_source}))
