"""The verify jobs: two checkpoints of any formats compared tensor by tensor, or one of ours
re-read from disk against the checksums recorded when it was imported.

- `verify(a, b)`: both opened (`jobs.open`) and, with a model config, reduced to the model's
  tensors under HF names (`naming.model_hf`); without one, compared under the source's names.
  Params, every optimizer slot, the step and the trainer-state values both record; per tensor
  the max |a - b| in float64 (NaN equal to NaN), read in blocks of rows (bounded memory);
  `atol=0` means bit for bit.
- `verify_checksums(path)`: every array of the params and optimizer items read from disk (lazily,
  a fresh TensorStore context, one tile at a time: bounded memory) and its checksum
  (`hybridckpt.checksum`) compared with `trainer_state["checksums"]`: by the definition
  `trainer_state["checksum_algorithm"]` names (`CHUNKS`, on the grid recorded in
  `"checksum_chunks"`, read box by box from whatever chunk layout is on disk now), or
  `ELEMENTS` for imports that recorded no algorithm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.io import byte_source
from hybridckpt.io.remote.view import local_path
from hybridckpt.lazy import LazyTensor

Progress = Callable[[str, int], None]
TILE_BYTES = 64 << 20  # verify_checksums reads at most this many bytes of an array at once


@dataclass(frozen=True)
class TensorDiff:
    """One compared item: a tensor (`kind` "param", or "slot" with the slot in its name,
    `name [exp_avg]`), the optimizer step ("step") or a trainer-state value ("trainer")."""

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    ok: bool
    reason: str = ""  # why a row is bad: "differs", "not recorded", "unreadable: ...", "a: 3, b: 4"
    kind: str = "param"


COMPARE_BLOCK_BYTES = 64 << 20  # a tensor is compared this many bytes of rows at a time
TRAINER_KEYS = ("consumed_samples", "batch_index", "global_batch_size", "lr")  # compared where both record them


def _blocks(t: LazyTensor):
    """`t`'s C-order blocks of leading rows of at most COMPARE_BLOCK_BYTES (bounded memory)."""
    if not t.shape:
        yield ()
        return
    row = math.prod(t.shape[1:]) * np.dtype(t.dtype).itemsize
    step = max(1, COMPARE_BLOCK_BYTES // max(row, 1))
    rest = tuple((0, n) for n in t.shape[1:])
    for a in range(0, max(t.shape[0], 1), step):
        yield ((a, min(t.shape[0], a + step)), *rest)


def _max_diff(ta: LazyTensor, tb: LazyTensor) -> float:
    """max |a - b| in float64 over both tensors (NaN equal to NaN), block by block."""
    diff = 0.0
    for box in _blocks(ta):
        xa = ta.read_box(box).astype(np.float64)
        xb = tb.read_box(box).astype(np.float64)
        d = np.where(np.isnan(xa) & np.isnan(xb), 0.0, np.abs(xa - xb))
        if d.size:
            diff = max(diff, float(d.max()))
    return diff


def compare_tensors(
    a: Mapping[str, LazyTensor], b: Mapping[str, LazyTensor], atol: float = 0.0, on_tensor: Progress | None = None,
    kind: str = "param",
) -> tuple[list[TensorDiff], list[str], list[str]]:
    """Per-tensor max |a - b| (in float64), plus names only in a and only in b."""
    rows = []
    for name in sorted(set(a) & set(b)):
        ta, tb = a[name], b[name]
        if ta.shape != tb.shape:
            rows.append(TensorDiff(name, tuple(ta.shape), float("inf"), False,
                                   f"shapes differ: {list(ta.shape)} vs {list(tb.shape)}", kind))
            continue
        diff = _max_diff(ta, tb)
        rows.append(TensorDiff(name, tuple(ta.shape), diff, diff <= atol, "" if diff <= atol else "values differ", kind))
        if on_tensor:
            on_tensor(name, ta.nbytes)
    return rows, sorted(set(a) - set(b)), sorted(set(b) - set(a))


def _model_named(opened: Any) -> Any:
    from hybridckpt import naming

    if opened.config is None:
        return opened.named
    return naming.model_hf(opened.named, opened.config)


def _steps_of(a: str | os.PathLike, b: str | os.PathLike, step: int | None) -> tuple[int | None, int | None]:
    """`step` for each of `a`, `b` that is a folder of several steps (None for the other)."""
    if step is None:
        return None, None
    from hybridckpt.formats import registry

    held = [registry.step_folders(os.path.abspath(os.fspath(local_path(p)))) is not None for p in (a, b)]
    if not any(held):
        raise CheckpointError(
            f"step {step}: neither {os.fspath(a)} nor {os.fspath(b)} is a folder of several steps (ours, "
            f"step-N/, checkpoint-N/, iter_N/, global_stepN/, N/): there is no step to pick"
        )
    return tuple(step if h else None for h in held)


def verify(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    atol: float = 0.0,
    config: Any = None,
    progress: Progress | None = None,
    params_only: bool = False,
    verify_reads: bool = True,
    step: int | None = None,
    param_order: Any = None,
) -> tuple[list[TensorDiff], list[str], list[str]]:
    """Compare two checkpoints of any formats (under HF names when a model config is known):
    every param, and unless `params_only` every optimizer slot's tensor (`name [slot]`), the
    optimizer step and the trainer-state values both record (`TRAINER_KEYS`). Returns (rows,
    names only in a, names only in b); a checkpoint without optimizer state beside one with it
    is one entry, `[optimizer state: ...]`, in the other's list. `step` picks that step of each
    side that is a folder of several steps (ours, `step-N/`, `checkpoint-N/`, ...); a side of one
    step is read as it is; neither being one is a CheckpointError. A file of either that changed
    while it was read is a FormatError (`io.byte_source.watch`): the verdict would be of neither.
    `param_order` names an index-keyed optimizer state of either side (`open_checkpoint`).
    `verify_reads=False` reads the side(s) that are ours unchecked; with neither ours it is a
    ConfigError (no format but ours records CRC-32s)."""
    with byte_source.watch() as watched:
        out = _verify(a, b, atol=atol, config=config, progress=progress, params_only=params_only,
                      verify_reads=verify_reads, step=step, param_order=param_order)
        watched.check()
    return out


def _ours(path) -> bool:
    """Whether `path` is one of our (Orbax) checkpoints (False when it cannot be told: opening
    it then says why)."""
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.formats import registry

    try:
        return registry.detect(os.path.abspath(local_path(path))) == "orbax"
    except (HybridCkptError, OSError, ValueError):
        return False


def _verify(a, b, *, atol, config, progress, params_only, verify_reads, step, param_order=None):
    from hybridckpt.formats.index_naming import IfIndexKeyed, order_arg
    from hybridckpt.jobs.open import open_checkpoint

    step_a, step_b = _steps_of(a, b, step)
    names, source = order_arg(param_order)
    if names is not None:  # (the side whose optimizer state is keyed by index takes it)
        param_order = IfIndexKeyed(names, source)
    unchecked = [not verify_reads and _ours(p) for p in (a, b)]  # (only our side has reads to leave unchecked)
    oa, ob = (open_checkpoint(p, config=config, verify_reads=not u, step=s, param_order=param_order)
              for p, s, u in ((a, step_a, unchecked[0]), (b, step_b, unchecked[1])))
    if not verify_reads and not any(unchecked):
        why = (f"neither {a} ({oa.format}) nor {b} ({ob.format}) is one of our (Orbax) checkpoints, whose "
               "reads are checked against the CRC-32s their import recorded: there is no check to turn off")
        raise ConfigError(f"verify_reads=False: {why}", cli=f"--no-verify-reads: {why}")
    if names is not None and not any(param_order.source in n for o in (oa, ob) for n in o.notes):
        raise ConfigError(f"{source}: neither {a} nor {b} holds an optimizer state keyed by parameter index: nothing to order")
    na, nb = _model_named(oa), _model_named(ob)
    rows, only_a, only_b = compare_tensors(na.params, nb.params, atol, progress)
    if params_only:
        return rows, only_a, only_b
    if bool(na.slots) != bool(nb.slots):
        held = na.slots or nb.slots
        entry = (f"[optimizer state: {sum(len(t) for t in held.values())} tensors of slots "
                 f"{', '.join(sorted(held))}; compare params alone with params_only / --params-only]")
        (only_a if na.slots else only_b).append(entry)
        return rows, only_a, only_b
    for slot in sorted(set(na.slots) | set(nb.slots)):
        sa = {f"{n} [{slot}]": t for n, t in na.slots.get(slot, {}).items()}
        sb = {f"{n} [{slot}]": t for n, t in nb.slots.get(slot, {}).items()}
        r, oa_, ob_ = compare_tensors(sa, sb, atol, progress, kind="slot")
        rows, only_a, only_b = rows + r, only_a + oa_, only_b + ob_
    if na.slots:
        same = na.step == nb.step
        rows.append(TensorDiff("step", (), 0.0 if same else float("inf"), same,
                               "" if same else f"a: {na.step}, b: {nb.step}", "step"))
    for key in TRAINER_KEYS:
        va, vb = oa.trainer.get(key), ob.trainer.get(key)
        if va is not None and vb is not None:
            same = va == vb
            rows.append(TensorDiff(f"trainer_state.{key}", (), 0.0 if same else float("inf"), same,
                                   "" if same else f"a: {va!r:.40}, b: {vb!r:.40}", "trainer"))
    return rows, only_a, only_b


def compared(rows: list[TensorDiff]) -> str:
    """What `verify` compared, in words: "12 params, 24 optimizer tensors (exp_avg, exp_avg_sq),
    the step, trainer state consumed_samples"."""
    params = sum(r.kind == "param" for r in rows)
    slots = sorted({r.name.rsplit(" [", 1)[-1].rstrip("]") for r in rows if r.kind == "slot"})
    out = [f"{params} params"]
    if slots:
        out.append(f"{sum(r.kind == 'slot' for r in rows)} optimizer tensors ({', '.join(slots)})")
    if any(r.kind == "step" for r in rows):
        out.append("the step")
    keys = [r.name.split(".", 1)[1] for r in rows if r.kind == "trainer"]
    if keys:
        out.append(f"trainer state {', '.join(keys)}")
    return ", ".join(out)


def _tiles(shape: tuple[int, ...], itemsize: int) -> list[tuple[tuple[int, int], ...]]:
    """Boxes along dim 0 of at most TILE_BYTES each (whole rows; one row when a row is larger)."""
    if not shape:
        return [()]
    row = math.prod(shape[1:]) * itemsize
    per = max(1, TILE_BYTES // max(row, 1))
    rest = tuple((0, n) for n in shape[1:])
    return [((i, min(shape[0], i + per)), *rest) for i in range(0, shape[0], per)] or [((0, 0), *rest)]


def verify_checksums(
    path: str | os.PathLike, *, step: int | None = None, progress: Progress | None = None
) -> list[TensorDiff]:
    """Re-read every array of one of our checkpoints from disk and compare its checksum with the
    one recorded at import, and every config and tokenizer file it kept (rows `hf_files/<name>`);
    max_abs_diff is 0 (match) or inf (differs, or not recorded)."""
    from hybridckpt import checksum, optim
    from hybridckpt.containers.orbax.reader import UnreadableArray, item_arrays
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.formats.orbax_store import resolve
    from hybridckpt.formats.registry import require_store
    from hybridckpt.io.paths import given

    path = given(path, "the checkpoint")
    path = require_store(path)  # another format's checkpoint: named, with the import to run; a URL: its view
    root, step, state = resolve(path, step)
    recorded = state.get("checksums")
    if not recorded:
        raise CheckpointError(f"{path}: no checksums recorded (`hybridckpt import` and CheckpointStore saves of arrays record them)")
    step_dir = os.path.join(root, str(step))
    arrays = {f"params.{k}": v for k, v in item_arrays(os.path.join(step_dir, "params"), unreadable="keep").items()}
    if os.path.isdir(os.path.join(step_dir, "opt_state")):
        opt = optim.get(state.get("optimizer") or optim.DEFAULT)
        leaves = item_arrays(os.path.join(step_dir, "opt_state"), unreadable="keep")
        for slot in opt.slots:
            prefix = opt.orbax_prefix(slot.name)
            arrays |= {f"{slot.state_name}.{k[len(prefix):]}": v for k, v in leaves.items() if k.startswith(prefix)}
        if opt.orbax_step in leaves and "count" in recorded:
            arrays["count"] = leaves[opt.orbax_step]
    algorithm = state.get("checksum_algorithm", checksum.ELEMENTS)
    if algorithm not in checksum.ALGORITHMS:
        raise CheckpointError(
            f"{path}: trainer_state checksum_algorithm is {algorithm!r}; expected one of {list(checksum.ALGORITHMS)}"
        )
    grids = state.get("checksum_chunks") or {}
    rows = []
    for name in sorted(set(recorded) | set(arrays)):
        if name not in arrays:
            rows.append(TensorDiff(name, (), float("inf"), False, "recorded at import, missing now"))
            continue
        t = arrays[name]
        if isinstance(t, UnreadableArray):
            rows.append(TensorDiff(name, (), float("inf"), False, f"unreadable: {t.reason}"))
            continue
        shape = tuple(t.shape)
        try:
            if algorithm == checksum.ELEMENTS:
                boxes = _tiles(shape, np.dtype(t.dtype).itemsize)
                parts = [checksum.box_part(shape, box, t.read_box(box)) for box in boxes]
            elif name not in grids:
                rows.append(TensorDiff(name, shape, float("inf"), False, "no chunk grid recorded at import"))
                continue
            else:
                grid = tuple(int(c) for c in grids[name])
                parts = [checksum.chunk_part(shape, grid, b, t.read_box(b)) for b in checksum.grid_boxes(shape, grid)]
        except ValueError as e:  # a recorded grid that does not fit the array on disk
            rows.append(TensorDiff(name, shape, float("inf"), False, f"unreadable: {e}"))
            continue
        except HybridCkptError as e:
            rows.append(TensorDiff(name, shape, float("inf"), False, f"unreadable: {e}"))
            continue
        ok = name in recorded and checksum.to_hex(checksum.combine(parts)) == recorded[name]
        reason = "" if ok else ("not recorded at import" if name not in recorded else "checksum differs")
        rows.append(TensorDiff(name, shape, 0.0 if ok else float("inf"), ok, reason))
        if progress:
            progress(name, t.nbytes)
    return rows + _carried_files(step_dir, state)


def _carried_files(step_dir: str, state: dict) -> list[TensorDiff]:
    """One row per config or tokenizer file the import kept (`io.model_files`), read against the
    size and CRC-32 it recorded."""
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.formats.orbax_store import stored_files

    try:
        files = stored_files(step_dir, state)
    except HybridCkptError as e:
        return [TensorDiff("hf_files", (), float("inf"), False, f"unreadable: {e}", kind="file")]
    rows = []
    for name, f in sorted(files.items()):
        try:
            f.read()
            rows.append(TensorDiff(f"hf_files/{name}", (), 0.0, True, kind="file"))
        except HybridCkptError as e:
            rows.append(TensorDiff(f"hf_files/{name}", (), float("inf"), False, f"unreadable: {e}", kind="file"))
    return rows
