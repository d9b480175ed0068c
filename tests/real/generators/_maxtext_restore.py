"""The steps MaxText's weights cases share (`_maxtext_<family>.py`, `_maxtext_weights_only.py`):
our `export --to maxtext` of a source case, scanned and `--no-scan-layers`; MaxText restoring an
export by `load_parameters_path` and running its forward; our export read back as numpy; the
bit-for-bit comparison of two flat param dicts; MaxText's save of the params it restored, as its
converters save weights (`TrainState(step=0, params, opt_state={})` through
`checkpointing.save_checkpoint`). A part of `maxtext.py` (loaded by `_maxtext_weights_only.py`,
`gen` set to the maxtext generator: `maxtext_setup`, `flat_params`, `nested`, `tools`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import numpy as np

gen = None  # the maxtext generator module (set by _maxtext_weights_only)

# the distributions a weights case's manifest records (transformers where the host ran it)
DISTS = ["maxtext", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy"]
DISTS_HF = [*DISTS[:-1], "transformers", "numpy"]


def rel(a, b) -> float:
    """max |a - b| / max |b|: how far a forward `a` is from the reference `b`."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def overrides(path: str, extra: list[str]) -> list[str]:
    """The overrides of the export at `path` (its maxtext_overrides.json) as MaxText's `key=value`
    arguments, then `extra`."""
    doc = json.load(open(os.path.join(path, "maxtext_overrides.json")))
    return [f"{k}={v}" for k, v in doc["overrides"].items()] + extra


def export_both(source, host_python: str) -> tuple[str, str, str, dict]:
    """Our `export --to maxtext` of `source/ckpt` (run by the host's Python), scanned and
    unscanned, in a new work folder: (work, scanned, unscanned, the scanned one's overrides doc)."""
    work = tempfile.mkdtemp(prefix="mx-gen-")
    ours, ours_unscanned = os.path.join(work, "ours"), os.path.join(work, "ours_unscanned")
    host = [host_python, "-m", "hybridckpt.cli", "export", str(source / "ckpt")]
    subprocess.run([*host, ours, "--to", "maxtext"], check=True)
    subprocess.run([*host, ours_unscanned, "--to", "maxtext", "--no-scan-layers"], check=True)
    return work, ours, ours_unscanned, json.load(open(os.path.join(ours, "maxtext_overrides.json")))


def stored_params(path: str) -> dict[str, np.ndarray]:
    """The flat params of our export at `path` (its item `0/items`) as numpy (written on 8
    simulated devices: no shardings to restore)."""
    import jax
    import orbax.checkpoint as ocp

    item = os.path.join(path, "0", "items")
    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(item)
    meta = getattr(meta, "item_metadata", meta)
    args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    return gen.flat_params(ckptr.restore(item, restore_args=args)["params"]["params"])


def restore_run(model_name: str, block: str, path: str, tokens, extra: list[str], item: str | None = None):
    """MaxText's model `model_name` with the overrides of the export at `path` and `extra`,
    restored by `load_parameters_path` from `item` (default: the export's `0/items`), its
    `decoder_block` checked to be `block`, run on `tokens` [batch, seq] (positions 0..seq-1):
    (config, module, its restored flat params, logits)."""
    from maxtext.common import train_state_nnx

    load = item or f"{path}/0/items"
    config, module, state = gen.maxtext_setup(None, model_name, overrides(path, [f"load_parameters_path={load}",
                                                                                 *extra]))
    assert config.decoder_block.value == block, config.decoder_block
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    logits = np.asarray(module.model(tokens, positions, enable_dropout=False))
    return config, module, gen.flat_params(train_state_nnx.to_checkpoint_dict(state)["params"]["params"]), logits


def assert_same(mine: dict[str, np.ndarray], theirs: dict[str, np.ndarray], cast: bool = True) -> None:
    """The same names, and every array of `mine` is `theirs` exactly: cast to its dtype (MaxText
    restores into its weight_dtype float32), or (`cast` False) of the same dtype, bit for bit."""
    assert sorted(mine) == sorted(theirs), sorted(set(mine) ^ set(theirs))
    for k, v in mine.items():
        assert theirs[k].shape == v.shape, k
        assert np.array_equal(theirs[k], v.astype(theirs[k].dtype)) if cast else (
            theirs[k].dtype == v.dtype and np.array_equal(theirs[k], v)), k


def save_weights(out: str, case_name: str, params: dict[str, np.ndarray], config) -> str:
    """A fresh case folder `out/case_name` whose `ckpt/` is MaxText's save of the flat `params`, as
    its converters save weights (TrainState step 0, opt_state {}); its path."""
    from flax.training import train_state
    from maxtext.common import checkpointing

    saved = train_state.TrainState(step=0, apply_fn=None, params={"params": gen.nested(params)}, tx=None, opt_state={})
    case = gen.tools.fresh_case(out, case_name)
    mngr = checkpointing.create_orbax_checkpoint_manager(os.path.join(case, "ckpt"), True, False, 1,
                                                         use_ocdbt=False, use_zarr3=False)
    checkpointing.save_checkpoint(mngr, 0, saved, config=config, force=True)
    checkpointing.wait_until_finished(mngr)
    return case


def scanned_and_unscanned(model_name: str, block: str, ours: str, ours_unscanned: str, tokens, hf, tolerance: float,
                          unscanned_layer: str):
    """MaxText's dense-matmul forward of our scanned export `ours` and of the unscanned one
    (`scan_layers=False`, its params per layer: `unscanned_layer` among them), each within
    `tolerance` of the reference logits `hf`, the params it restored equal to ours (cast to its
    fp32): (config, scanned params, logits, unscanned logits, rel, unscanned rel)."""
    config, _, params, logits = restore_run(model_name, block, ours, tokens, ["sparse_matmul=False"])
    rel_scanned = rel(logits, hf)
    print("maxtext vs hf", rel_scanned)
    assert rel_scanned < tolerance, rel_scanned
    assert_same(stored_params(ours), params)

    _, _, params_unscanned, logits_unscanned = restore_run(model_name, block, ours_unscanned, tokens,
                                                           ["scan_layers=False", "sparse_matmul=False"])
    assert any(k.startswith(unscanned_layer) for k in params_unscanned), sorted(params_unscanned)[:5]
    assert_same(stored_params(ours_unscanned), params_unscanned)
    rel_unscanned = rel(logits_unscanned, hf)
    assert rel_unscanned < tolerance, rel_unscanned
    return config, params, logits, logits_unscanned, rel_scanned, rel_unscanned
