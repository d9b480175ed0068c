"""MaxText checkpoints (AI-Hypercomputer/maxtext 0.2.5): the on-disk layout, its mapping to HF
names, and its detection (the reader, which reads the arrays with our Orbax reader, is
`formats/maxtext/__init__.py`; the writer `formats/maxtext/write.py`).

Layout (docs/maxtext.md, with citations): a checkpoint root holds one folder per step,
`<root>/<step>/`, with `_CHECKPOINT_METADATA` and one Orbax pytree item `items/` (zarr arrays and
`_METADATA`). The item is MaxText's Linen train state (`train_state_nnx.to_checkpoint_dict` for an
NNX run, the same layout):

    params.params.<MaxText param path>       the weights (`params` collection)
    opt_state.0.count                        optax ScaleByAdamState: steps taken (int32, [])
    opt_state.0.mu.params.<path>             Adam's first moment, like its param
    opt_state.0.nu.params.<path>             Adam's second moment
    opt_state.1                              None (add_decayed_weights: no state)
    opt_state.2.count                        ScaleByScheduleState: the schedule's step
    step                                     the train step (int32, [])

Scanned layers (`scan_layers: true`, the default) are one array per parameter under
`decoder.layers.`, the layer axis at `param_scan_axis` (1): `decoder.layers.self_attention.
query.kernel` is `[embed, layers, heads, head_dim]`, a norm scale `[embed, layers]`, an MoE expert
kernel `[experts, layers, in, out]`. Unscanned ones are `decoder.layers_<i>.<path>`. Internally (and in the family's `maxtext.rules`) a
stacked parameter has its layer axis first (`STACK`), as our rules stack; `to_disk` and
`from_disk` move it.

DeepSeek's decoder scans two stacks (`STACKS`): `decoder.dense_layers.*` and `decoder.moe_layers.*`
(unscanned `decoder.dense_layers_<i>.*`, `decoder.moe_layers_<i>.*`, each counted from 0); its
router bias is a MaxText variable, not a param, stacked on axis 0 by the scan: the dialect's
`LAYER_AXIS_0` names keep their layer axis first on disk.

A decoder of several layer kinds (Llama 4: MoE and dense, NoPE and RoPE layers) is scanned in
blocks of `inhomogeneous_layer_cycle_interval` (c, the dialect's `layer_cycle(cfg)`) layers: the
scanned tree is `decoder.layers.layers_<p>.<path>` (p < c), holding layers p, p + c, p + 2c, ...
on the scan axis (maxtext 0.2.5 layers/nnx_decoders.py `_init_scanned_generic`, models/llama4.py
`Llama4ScannableBlock`). Such a family's rules name each layer by its unscanned name
`decoder.layers_$L.<path>` (a layer's own tree, no stack); `to_disk` / `from_disk` with `cycle`
move between that and the scanned form. A block of nested groups (Qwen3-Next: `local_layers` /
`global_layer`, the dialect's `scan_groups(cfg)`) is `formats/maxtext/scan_groups.py`'s.

The names and value ops per family are the family's `maxtext` dialect (`models/<family>/
dialects/maxtext.{rules,py}`): MaxText names -> HF names; `rules(cfg)` parses them, the writer
inverts them (formats/maxtext/write.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from hybridckpt import lazy
from hybridckpt.errors import ConfigError, FormatError, MappingError
from hybridckpt.formats.maxtext import scan_groups as scan_groups_io
from hybridckpt.formats.maxtext.scan_groups import ScanGroup, groups_of
from hybridckpt.io import json_text
from hybridckpt.io.regular_file import NotRegular, open_regular_file
from hybridckpt.io.step_folders import StepFolders, StepPattern, listing
from hybridckpt.lazy import LazyTensor

NAME = "maxtext"
STEP_DIRS = StepPattern("")  # `<root>/<step>/`: Orbax CheckpointManager step folders
ITEM = "items"  # the checkpointable MaxText's Checkpointer saves the train state as
PARAMS = "params.params."
MU = "opt_state.0.mu.params."
NU = "opt_state.0.nu.params."
ADAM_COUNT = "opt_state.0.count"
SCHEDULE_COUNT = "opt_state.2.count"
STEP = "step"
SLOTS = {"exp_avg": MU, "exp_avg_sq": NU}  # our slot name -> its prefix in the item
LAYERS = "decoder.layers."  # the scanned block: every name under it is stacked
# every scanned stack: DeepSeek's decoder scans its dense and MoE layers apart (models/deepseek.py)
STACKS = (LAYERS, "decoder.dense_layers.", "decoder.moe_layers.")
SCAN_AXIS = 1  # MaxText's param_scan_axis default (configs/base.yml)
_UNSCANNED = re.compile(r"^decoder\.layers_(\d+)\.(.+)$")
_UNSCANNED_ANY = re.compile(r"^(decoder\.(?:layers|dense_layers|moe_layers))_(\d+)\.(.+)$")
_CYCLE_SCANNED = re.compile(r"^decoder\.layers\.layers_(\d+)\.(.+)$")


# -- the mapping ------------------------------------------------------------------------------------


def dialect(cfg: Any):
    """The family's `maxtext` dialect, or a ConfigError naming the families that have one."""
    from hybridckpt import models

    fam = models.family_of(cfg)
    found = fam.dialect(NAME)
    if found is None:
        have = sorted(models.dialects(NAME))
        raise ConfigError(f"MaxText: no mapping for family {fam.name!r} (families with one: {', '.join(have)})")
    return found


def rule_vars(cfg: Any) -> dict[str, Any]:
    """The dialect's own rule variables (`variables(cfg)` of its `maxtext.py`)."""
    fn = dialect(cfg).get("variables")
    return dict(fn(cfg)) if fn is not None else {}


def rules(cfg: Any):
    """The family's MaxText -> HF rules for `cfg` (a `RuleSet`; `.invert()` is the export's)."""
    from hybridckpt import models
    from hybridckpt.rules import parse_rules

    text, origin = dialect(cfg).rules()
    return parse_rules(text, {**models.rule_variables(cfg), **rule_vars(cfg)}, origin=origin)


def overrides(cfg: Any) -> dict[str, Any]:
    """The MaxText config overrides that build `cfg`'s model (model_name and the sizes)."""
    d = dialect(cfg)
    return {"model_name": d.get("MODEL_NAME"), "override_model_config": True, **d.get("overrides")(cfg)}


def notes(cfg: Any) -> list[str]:
    fn = dialect(cfg).get("notes")
    return list(fn(cfg)) if fn is not None else []


def layer_axis_0(cfg: Any) -> tuple[str, ...]:
    """Name endings (the dialect's `LAYER_AXIS_0`) of stacked arrays whose layer axis stays at 0
    when scanned: MaxText's non-Param variables (DeepSeek's router bias, a `MoEBiasVar`) are
    stacked on axis 0 by its scan, not on `param_scan_axis`."""
    return tuple(dialect(cfg).get("LAYER_AXIS_0", ()))


def stack_of(name: str) -> str | None:
    """The scanned stack (`STACKS`) `name` lies under, or None."""
    return next((s for s in STACKS if name.startswith(s)), None)


def layer_cycle(cfg: Any) -> int | None:
    """The dialect's scan block (`layer_cycle(cfg)`, MaxText's `inhomogeneous_layer_cycle_interval`)
    when its rules name layers `decoder.layers_$L.*`; None for a stacked (`decoder.layers.X[$L]`) one."""
    fn = dialect(cfg).get("layer_cycle")
    return int(fn(cfg)) if fn is not None else None


def scan_groups(cfg: Any) -> tuple[ScanGroup, ...] | None:
    """The dialect's nested scan groups of a block (`scan_groups(cfg)`, formats/maxtext/
    scan_groups.py), or None: the block scanned as `decoder.layers.layers_<p>`."""
    fn = dialect(cfg).get("scan_groups")
    return groups_of(fn(cfg), layer_cycle(cfg)) if fn is not None else None


# -- the layer axis ---------------------------------------------------------------------------------


def _to_axis(t: LazyTensor) -> LazyTensor:
    """`[layers, ...]` -> the layer axis at `SCAN_AXIS`."""
    perm = list(range(1, t.ndim))
    perm.insert(SCAN_AXIS, 0)
    return lazy.transpose(t, perm)


def to_disk(
    tensors: Mapping[str, LazyTensor], scan_layers: bool = True, cycle: int | None = None,
    groups: tuple[ScanGroup, ...] | None = None, *, axis0: tuple[str, ...] = (),
) -> dict[str, LazyTensor]:
    """Names with the layer axis first (`decoder.layers.X`, `[layers, ...]`; any of `STACKS`) ->
    MaxText's: the axis moved to `SCAN_AXIS` (scanned; kept at 0 for a name ending in one of
    `axis0`) or one `decoder.layers_<i>.X` (`decoder.moe_layers_<i>.X`, ...) per layer. With `cycle`
    (the names are per layer, `decoder.layers_<i>.X`): scanned, layers i = b * cycle + p become
    `decoder.layers.layers_<p>.X` with b on `SCAN_AXIS` (lazily stacked), or into `groups`
    (scan_groups.py); unscanned, as they are."""
    if cycle is not None and groups is not None and scan_layers:
        _check_blocks(tensors, cycle)
        return scan_groups_io.to_disk(tensors, cycle, groups)
    if cycle is not None:
        return _cycle_to_disk(tensors, scan_layers, cycle)
    out: dict[str, LazyTensor] = {}
    for name, t in tensors.items():
        stack = stack_of(name)
        if stack is None:
            out[name] = t
        elif scan_layers:
            out[name] = t if name.endswith(axis0) and axis0 else _to_axis(t)
        else:
            rest = name[len(stack):]
            for i in range(t.shape[0]):
                out[f"{stack[:-1]}_{i}.{rest}"] = lazy.index0(t, i)
    return out


def _check_blocks(tensors: Mapping[str, LazyTensor], cycle: int) -> None:
    layers = [int(m.group(1)) for m in map(_UNSCANNED.match, tensors) if m is not None]
    n = 1 + max(layers) if layers else 0
    if n % cycle:
        raise ConfigError(
            f"MaxText scans this model in blocks of {cycle} layers (inhomogeneous_layer_cycle_interval) and "
            f"drops a remainder: {n} layers do not divide into them (--no-scan-layers writes them unscanned)"
        )


def _cycle_to_disk(tensors: Mapping[str, LazyTensor], scan_layers: bool, cycle: int) -> dict[str, LazyTensor]:
    out: dict[str, LazyTensor] = {}
    per_layer: dict[str, dict[int, LazyTensor]] = {}
    for name, t in tensors.items():
        m = _UNSCANNED.match(name)
        if m is None or not scan_layers:
            out[name] = t
        else:
            per_layer.setdefault(m.group(2), {})[int(m.group(1))] = t
    if not per_layer:
        return out
    _check_blocks(tensors, cycle)
    n = 1 + max(i for layers in per_layer.values() for i in layers)
    for rest, layers in per_layer.items():
        kinds = {i % cycle for i in layers}
        for p in sorted(kinds):
            want = list(range(p, n, cycle))
            if sorted(i for i in layers if i % cycle == p) != want:
                raise MappingError(
                    f"export --to maxtext: decoder.layers_<i>.{rest}: a scanned block position {p} needs layers "
                    f"{want}, found {sorted(i for i in layers if i % cycle == p)}"
                )
            out[f"{LAYERS}layers_{p}.{rest}"] = _to_axis(lazy.Stack(tuple(layers[i] for i in want)))
    return out


def _cycle_from_disk(tensors: Mapping[str, LazyTensor], where: str, cycle: int, num_layers: int) -> dict[str, LazyTensor]:
    """`decoder.layers.layers_<p>.X` (b on `SCAN_AXIS`) -> `decoder.layers_<b * cycle + p>.X`;
    unscanned names as they are. A block position must hold exactly the layers p, p + cycle, ...
    below `num_layers` (the config's): the scan axis is checked before any view is made."""
    out: dict[str, LazyTensor] = {}
    for name, t in tensors.items():
        m = _CYCLE_SCANNED.match(name)
        if m is None:
            if name.startswith(LAYERS):
                raise FormatError(f"{where}: {name}: expected {LAYERS}layers_<p>.* (p < {cycle}) in a model scanned "
                                  f"in blocks of {cycle} layers")  # fmt: skip
            out[name] = t
            continue
        p = int(m.group(1))
        blocks = len(range(p, num_layers, cycle))
        if p >= cycle or t.ndim <= SCAN_AXIS or t.shape[SCAN_AXIS] != blocks:
            raise FormatError(f"{where}: {name}: expected a block position < {cycle} holding {blocks} of the "
                              f"{num_layers} layers on axis {SCAN_AXIS}, found shape {t.shape}")  # fmt: skip
        first = lazy.transpose(t, [SCAN_AXIS] + [a for a in range(t.ndim) if a != SCAN_AXIS])
        for b in range(blocks):
            layer = f"decoder.layers_{b * cycle + p}.{m.group(2)}"
            if layer in tensors:
                raise FormatError(f"{where}: {layer} is both scanned ({name}) and unscanned")
            out[layer] = lazy.index0(first, b)
    return out


def from_disk(
    tensors: Mapping[str, LazyTensor], where: str, cycle: int | None = None, num_layers: int = 0,
    groups: tuple[ScanGroup, ...] | None = None, *, axis0: tuple[str, ...] = (),
) -> dict[str, LazyTensor]:
    """MaxText's names -> the rules' source names, the layer axis first: a scanned array with
    its layer axis moved to 0, the unscanned `decoder.layers_<i>.X` of layers 0..n-1 stacked
    (lazily, `lazy.Stack`: its parts come back as they were) into `decoder.layers.X`, so that a
    rule stacked deeper than the layers (the experts' `[$L, $E]`) reads either alike. Unscanned
    layers that are not 0..n-1, or differ in shape or dtype, are a FormatError. With `cycle`
    (a model of `num_layers` layers scanned in blocks, module doc): per-layer names
    `decoder.layers_<i>.X` either way, from `groups` when the block nests them (scan_groups.py). Any
    of `STACKS` alike (`decoder.moe_layers_<i>.X` -> `decoder.moe_layers.X`); a scanned name ending
    in one of `axis0` has its layer axis at 0."""
    if cycle is not None and groups is not None:
        return scan_groups_io.from_disk(tensors, where, cycle, groups, num_layers)
    if cycle is not None:
        return _cycle_from_disk(tensors, where, cycle, num_layers)
    out: dict[str, LazyTensor] = {}
    per_layer: dict[str, dict[int, LazyTensor]] = {}
    for name, t in tensors.items():
        m = _UNSCANNED_ANY.match(name)
        if m:
            per_layer.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
        elif stack_of(name) is not None:
            if name.endswith(axis0) and axis0:
                if t.ndim < 1:
                    raise FormatError(f"{where}: {name}: a scanned array has a layer axis 0, found shape {t.shape}")
                out[name] = t
                continue
            if t.ndim <= SCAN_AXIS:
                raise FormatError(f"{where}: {name}: a scanned array has a layer axis {SCAN_AXIS}, found shape {t.shape}")
            perm = [SCAN_AXIS] + [a for a in range(t.ndim) if a != SCAN_AXIS]
            out[name] = lazy.transpose(t, perm)
        else:
            out[name] = t
    for name, layers in per_layer.items():
        stack = stack_of(name)
        each = f"{stack[:-1]}_<i>.{name[len(stack):]}"
        if name in out:
            raise FormatError(f"{where}: {name} is both scanned and unscanned ({each})")
        if sorted(layers) != list(range(len(layers))):
            raise FormatError(
                f"{where}: {each}: expected layers 0..{len(layers) - 1}, found {sorted(layers)}"
            )
        parts = [layers[i] for i in range(len(layers))]
        if len({(p.shape, str(p.dtype)) for p in parts}) != 1:
            raise FormatError(
                f"{where}: {each}: layers differ in shape or dtype "
                f"({sorted({(p.shape, str(p.dtype)) for p in parts})})"
            )
        out[name] = lazy.Stack(tuple(parts))
    return out


# -- the reader ------------------------------------------------------------------------------------


def steps(path: str) -> StepFolders | None:
    """The step folders `<root>/<N>/` of a MaxText run (`io.step_folders`: a folder holding
    `items/`), or None when `path` is a step or item folder itself, or holds no step."""
    norm = os.path.abspath(path)
    if not os.path.isdir(norm) or os.path.isfile(os.path.join(norm, "_METADATA")) or os.path.isdir(os.path.join(norm, ITEM)):
        return None
    found = listing(norm, STEP_DIRS, lambda f: os.path.isdir(os.path.join(f, ITEM)))
    return found if found.folders else None


def item_dir(path: str, step: int | None) -> tuple[str, int | None]:
    """(the `items` folder, the step its folder names) of `path`: a root, a step folder or the
    item folder itself."""
    norm = os.path.abspath(path)
    if os.path.basename(norm) == ITEM and os.path.isfile(os.path.join(norm, "_METADATA")):
        base = os.path.basename(os.path.dirname(norm))
        return norm, STEP_DIRS.number(base)
    if os.path.isfile(os.path.join(norm, ITEM, "_METADATA")):
        base = os.path.basename(norm)
        return os.path.join(norm, ITEM), STEP_DIRS.number(base)
    found = steps(norm)
    if found is None:
        raise FormatError(f"{path}: no MaxText checkpoint (expected <step>/{ITEM}/_METADATA)")
    pick = found.default if step is None else step
    return os.path.join(found.folder(pick), ITEM), pick


def _leaf_names(item_dir: str) -> list[str] | None:
    path = os.path.join(item_dir, "_METADATA")
    try:
        with open_regular_file(path) as f:
            meta = json_text.loads(f.read(), path)
    except (json_text.JsonTooDeep, NotRegular):
        raise  # before Orbax parses it (RecursionError), waits on it (a FIFO) or a reader walks it
    except (OSError, FormatError):
        return None
    tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
    if not isinstance(tree, dict):
        return None
    names = []
    for entry in tree.values():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if isinstance(keys, list):
            names.append(".".join(str(k.get("key")) for k in keys if isinstance(k, dict)))
    return names


MAX_PROBED = 4  # step folders whose `_METADATA` detection reads, latest first


def detect(path: str) -> bool:
    """A MaxText checkpoint: an Orbax item `items` whose leaves are `params.params.*`. A run
    folder is told by its latest step whose `_METADATA` parses (at most `MAX_PROBED` tried), so
    that a damaged latest step does not hide the others (`--step` reads them)."""
    if not os.path.isdir(path):
        return False
    found = steps(path)
    try:
        items = [item_dir(path, None)[0]] if found is None else [
            os.path.join(found.folders[s], ITEM) for s in found.steps[::-1][:MAX_PROBED]]
    except FormatError:
        return False
    for item in items:
        names = _leaf_names(item)
        if names is not None:
            return bool(names) and any(n.startswith(PARAMS) for n in names)
    return False
