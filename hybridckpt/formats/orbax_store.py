"""Our own checkpoint as a source: what every job sees of `DIR/<step>/{params,opt_state,...}`.

`open` gives a `SourceCheckpoint` like any format's, read lazily (`containers.orbax.reader`: a box read
fetches only the chunks it overlaps; nothing is restored whole):
- with a model config (`trainer_state["model_config"]`, or `config=`): the params under single-card
  HF names (the inverse of the family's rules) and each optimizer slot under the same names;
- without one (a model-agnostic import): the params under the names they were imported with.
The optimizer is the one named in `trainer_state["optimizer"]` (AdamW when absent); its slots are
read from the `opt_state` item at the optimizer's declared paths (`0.mu.*`, `0.nu.*`, `0.count`).
`detect` looks at names only and imports no JAX.
"""

from __future__ import annotations

import os
from typing import Any

NAME = "orbax"


def root_and_step(path: str) -> tuple[str, int | None]:
    """`DIR` or `DIR/<step>` -> (DIR, step or None)."""
    norm = os.path.normpath(path)
    base = os.path.basename(norm)
    if base.isdigit() and os.path.isdir(os.path.join(norm, "params")):
        return os.path.dirname(norm), int(base)
    return norm, None


def detect(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    _, step = root_and_step(path)
    if step is not None:
        return True
    return any(d.isdigit() and os.path.isdir(os.path.join(path, d, "params")) for d in os.listdir(path))


def resolve(path: str, step: int | None = None) -> tuple[str, int, dict]:
    """(root, step, trainer_state) of `path` (`DIR` or `DIR/<step>`; step default: latest).

    Read from the files when they are laid out as Orbax writes them locally (a finalised step is
    a folder named by its number: Orbax renames its temporary folder into place; the trainer
    state is the JSON file `<step>/trainer_state/metadata` of Orbax's JsonCheckpointHandler), so
    no JAX or Orbax is imported; through Orbax's manager otherwise."""
    from hybridckpt.errors import CheckpointError

    root, dir_step = root_and_step(os.path.abspath(path))
    found = steps(root) if dir_step is None and step is not None else None
    if found is not None and found.folders:
        found.folder(step)  # a step not on disk: one FormatError listing the steps that are
    if dir_step is not None and step not in (None, dir_step):
        from hybridckpt.errors import FormatError

        raise FormatError(f"{path}: no step {step}: this is the folder of step {dir_step} (give {root} to pick a step)")
    step = dir_step if step is None else step
    if step is None:
        held = _steps_on_disk(root)
        step = held[-1] if held else None
    state = None if step is None else _trainer_state_file(root, int(step))
    if state is not None:
        return root, int(step), checked_state(state, f"{root}/{step}/trainer_state/metadata")
    from hybridckpt.store.orbax_io import latest_step, read_trainer_state

    step = latest_step(root) if step is None else step
    if step is None:
        raise CheckpointError(f"{root}: no checkpoint steps")
    return root, int(step), checked_state(read_trainer_state(root, step), f"{root}/{step}/trainer_state")


# the trainer state's fields this reader uses, and the JSON types they must have when present
STATE_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,), "mesh": (dict,), "optimizer": (str,), "optimizer_hyper": (dict,), "weight_decay_mask": (dict,),
    "tensor_names": (dict,), "model_config": (dict,), "optimizer_param_groups": (list,), "hf_files": (dict,),
    "checksum_chunks": (dict,), "array_specs": (dict,), "checksums": (dict,),
}


def checked_state(state: Any, where: str) -> dict:
    """`state` (a step's trainer state, read from `where`) when it is a JSON object whose fields
    this reader uses have their types (`STATE_TYPES`; `null` stands for absent), the mesh's
    degrees ints; else a CheckpointError naming the field."""
    from hybridckpt.errors import CheckpointError

    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: the trainer state is a {type(state).__name__}, expected a JSON object")
    for key, types in STATE_TYPES.items():
        value = state.get(key)
        if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
            raise CheckpointError(f"{where}: {key!r} is a {type(value).__name__}, expected "
                                  f"{' or '.join(t.__name__ for t in types)}")
    mesh = state.get("mesh") or {}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in mesh.values()):
        raise CheckpointError(f"{where}: 'mesh' must map axis names to sizes, found {str(mesh)[:120]}")
    return state


def steps(path: str):  # -> io.step_folders.StepFolders | None
    """The step folders `DIR/<N>/` of our checkpoint `DIR` (`io.step_folders`: a folder holding
    `params/`), or None when `path` is one step's folder `DIR/<N>` or no folder."""
    from hybridckpt.io.step_folders import StepPattern, listing

    root, step = root_and_step(os.path.abspath(path))
    if step is not None or not os.path.isdir(root):
        return None
    return listing(root, StepPattern(""), lambda f: os.path.isdir(os.path.join(f, "params")))


def _steps_on_disk(root: str) -> list[int]:
    found = steps(root)
    return found.steps if found is not None else []


def _trainer_state_file(root: str, step: int) -> dict | None:
    """The trainer state JSON object of `step` read from its file, or None when there is no such
    file (Orbax's reader then decides); a file there that is not a JSON object is a FormatError
    naming it."""
    from hybridckpt.io.config_file import read_json

    path = os.path.join(root, str(step), "trainer_state", "metadata")
    if not os.path.lexists(path):
        return None
    return read_json(path)


def model_config(state: dict, config: Any = None) -> Any:
    """The model config of a checkpoint: `config` when given, else the saved one (None for a
    model-agnostic import)."""
    from hybridckpt import models

    if config is not None:
        return config
    saved = state.get("model_config")
    return None if saved is None else models.config_from_dict(saved)


def recorded_hyper(state: dict, params: dict, named) -> dict:
    """The optimizer hyper-parameters an import recorded (`optimizer_hyper`), with the weight
    decay mask (`weight_decay_mask`, by leaf) as torch-style groups under the names `named`
    gives each leaf's params (HF names with a model config)."""
    hyper = dict(state.get("optimizer_hyper") or {})
    mask = state.get("weight_decay_mask")
    if not hyper or not isinstance(mask, dict):
        return hyper
    groups = [{**hyper, "params": []}, {**hyper, "weight_decay": 0.0, "params": []}]
    for leaf, decays in mask.items():
        if leaf in params:
            groups[0 if decays else 1]["params"].extend(named({leaf: params[leaf]}))
    return {**hyper, "groups": groups}


def open(path: str, *, config: Any = None, step: int | None = None, verify_reads: bool = True):  # noqa: A001
    """Our checkpoint at `path` as a lazy `SourceCheckpoint` (see the module docstring). Every
    array is read through the CRC-32s its import recorded (`store.checked`) unless
    `verify_reads=False`."""
    from hybridckpt import naming, optim
    from hybridckpt.containers.orbax.keys import NAMES_KEY, original_names
    from hybridckpt.containers.orbax.reader import item_arrays, scalar_int
    from hybridckpt.source_checkpoint import OptimizerState, SourceCheckpoint
    from hybridckpt.store.checked import checked_arrays

    root, step, state = resolve(path, step)
    cfg = model_config(state, config)
    step_dir = os.path.join(root, str(step))

    def arrays(item: str, prefix: str = "") -> dict:
        folder = os.path.join(step_dir, item)
        found = item_arrays(folder)
        return checked_arrays(found, state, prefix, folder) if verify_reads else found

    params = arrays("params", "params.")

    def named(flat: dict) -> dict:
        return naming.tree_to_hf(flat, cfg) if cfg is not None else original_names(flat, state.get(NAMES_KEY))

    optimizer = None
    opt_step = state.get("step") if state.get("step") is not None else step
    if os.path.isdir(os.path.join(step_dir, "opt_state")):
        opt = optim.get(state.get("optimizer", optim.DEFAULT))
        leaves = item_arrays(os.path.join(step_dir, "opt_state"))
        slots = {}
        for slot in opt.slots:
            prefix = opt.orbax_prefix(slot.name)
            mine = {k[len(prefix):]: v for k, v in leaves.items() if k.startswith(prefix)}
            if verify_reads:
                mine = checked_arrays(mine, state, f"{slot.state_name}.", os.path.join(step_dir, "opt_state"))
            slots[slot.name] = named(mine)
        if opt.orbax_step in leaves:
            count = {"count": leaves[opt.orbax_step]}
            if verify_reads and "count" in (state.get("chunk_crc32") or {}):
                count = checked_arrays(count, state, "", os.path.join(step_dir, "opt_state"))
            opt_step = scalar_int(count["count"], opt.orbax_step, os.path.join(step_dir, "opt_state"))
        optimizer = OptimizerState(slots, opt_step, hyper=recorded_hyper(state, params, named))
    return SourceCheckpoint(
        format=NAME,
        path=path,
        tensors=named(params),
        optimizer=optimizer,
        config=cfg,
        step=opt_step,
        topology=dict(state.get("mesh") or {}),
        trainer=state,
        files=stored_files(step_dir, state),
    )


def stored_files(step_dir: str, state: dict) -> dict:
    """The config and tokenizer files an import kept in `<step>/hf_files/` (`io.model_files`),
    each to be read against the size and CRC-32 recorded in the trainer state."""
    from hybridckpt.io import model_files

    where = os.path.join(step_dir, "trainer_state")
    return model_files.recorded(os.path.join(step_dir, "hf_files"), state.get("hf_files"), f"{where} 'hf_files'")


def _config_json(saved: Any) -> Any:
    """A saved model config in today's JSON form (`models.config_to_dict`: RoPE scaling as an
    object, where stores written before hold pairs); as saved when it is not one we read."""
    from hybridckpt import models
    from hybridckpt.errors import HybridCkptError

    try:
        return None if saved is None else models.config_to_dict(models.config_from_dict(saved))
    except HybridCkptError:
        return saved


def _steps_by_orbax(root: str) -> list[int]:
    """The steps Orbax's manager finds, where the folder names alone did not say (loads JAX and
    Orbax, which `inspect` of a store otherwise never does)."""
    from hybridckpt.store.orbax_io import list_steps

    return list_steps(root)


def describe(path: str, step: int | None = None) -> dict:
    """What `inspect` shows of our checkpoint (`jobs.inspect.SCHEMA`): steps, config, mesh, the
    optimizer by its slots, the carried files, and the arrays as stored (Flax tree names, one
    piece each); reads metadata only."""
    from hybridckpt import optim
    from hybridckpt.containers.orbax.keys import NAMES_KEY, original_names
    from hybridckpt.containers.orbax.reader import item_arrays

    root, step, state = resolve(path, step)
    step_dir = os.path.join(root, str(step))
    arrays = original_names(item_arrays(os.path.join(step_dir, "params")), state.get(NAMES_KEY))
    optimizer = None
    if os.path.isdir(os.path.join(step_dir, "opt_state")):
        opt = optim.get(state.get("optimizer") or optim.DEFAULT)
        leaves = item_arrays(os.path.join(step_dir, "opt_state"))
        first = opt.orbax_prefix(opt.slots[0].name) if opt.slots else None
        optimizer = {
            "name": opt.name,
            "step": state.get("step", step),
            "slots": sorted(s.name for s in opt.slots),
            "params_with_state": sum(1 for k in leaves if first is not None and k.startswith(first)),
            "master_weights": 0,
            "hyper": dict(state.get("optimizer_hyper") or {}),
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": len(g.get("params") or [])}
                for g in state.get("optimizer_param_groups") or [] if isinstance(g, dict)
            ],
        }
    return {
        "format": NAME,
        "path": path,
        "step": step,
        "steps": _steps_on_disk(root) or _steps_by_orbax(root),  # (names only: no other step's files read)
        "topology": state.get("mesh", {}),
        "config": _config_json(state.get("model_config")),
        "needs_config": False,
        "optimizer": optimizer,
        "files": sorted(stored_files(step_dir, state)),
        "notes": [] if state.get("model_config") else ["imported without a model config: tensors keep the source's names"],
        "trainer_state": {k: v for k, v in state.items()
                          if k not in ("checksums", "checksum_chunks", "chunk_crc32", "array_specs", NAMES_KEY)},
        "tensors": [
            {"name": k, "shape": list(v.shape), "dtype": str(v.dtype), "pieces": 1} for k, v in arrays.items()
        ],
    }
