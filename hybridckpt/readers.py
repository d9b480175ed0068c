"""Every checkpoint reader, ours included, in detection order: the one registry of formats.

A format module (`hybridckpt/formats/<format>` or our own store's `hybridckpt/store/as_source.py`)
defines `NAME`, `detect(path) -> bool` (cheap: file names and a few bytes) and
`open(path, *, config=None) -> SourceCheckpoint` (pure planning from metadata; no tensor bytes
read). A format whose folders may hold several steps (`step-N/`, `checkpoint-N/`, `iter_N/`,
`global_stepN/`, `N/`) also defines `steps(path) -> io.step_folders.StepFolders | None` (None
when `path` is itself one step): `open_source(..., step=N)` opens that step's folder, and a
source of one step takes `step` only when it is that step. `READERS` lists (name, module) most specific first; `NAMES` is what `--format` accepts
(the CLI reads it without importing any reader). This module sits above both `formats` and
`store` (it imports them by the module names below, which tests/test_layers.py checks too).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import replace

from hybridckpt import values
from hybridckpt.errors import CheckpointError, FormatError, short_repr
from hybridckpt.io.step_folders import StepFolders
from hybridckpt.lazy import shape_problem
from hybridckpt.source_checkpoint import SourceCheckpoint

# (format name, module) in detection order, most specific first
READERS: tuple[tuple[str, str], ...] = (
    ("orbax", "hybridckpt.store.as_source"),
    ("maxtext", "hybridckpt.store.maxtext"),  # <step>/items of MaxText's train state
    ("megatron", "hybridckpt.formats.megatron"),
    ("meta-llama", "hybridckpt.formats.meta_llama"),
    ("megatron-dist", "hybridckpt.formats.megatron_dist"),  # before dcp: a torch_dist folder is a DCP folder too
    ("flex-checkpoint", "hybridckpt.formats.flex_checkpoint"),  # Paddle's {id}.metadata + {rank}_{id}.distcp
    ("hf-trainer", "hybridckpt.formats.trainer"),  # before dcp, deepspeed and hf: a layer over their files
    ("lightning", "hybridckpt.formats.lightning"),  # before dcp and torch: a .ckpt/ folder is DCP, a .ckpt file torch
    ("dcp", "hybridckpt.formats.dcp"),
    ("deepspeed-universal", "hybridckpt.formats.deepspeed.universal"),  # before deepspeed: its tag holds mp_rank_00_model_states.pt
    ("deepspeed", "hybridckpt.formats.deepspeed"),
    ("paddle", "hybridckpt.formats.paddle"),
    ("paddle-unified", "hybridckpt.formats.paddle.unified"),
    ("colossal", "hybridckpt.formats.colossal"),
    ("hf", "hybridckpt.formats.hf"),
    ("torch", "hybridckpt.formats.torch_file"),  # last: any torch.save file of a state dict, by its bytes
)
NAMES: tuple[str, ...] = tuple(name for name, _ in READERS)


def _module(path: str):
    return importlib.import_module(path)


def available() -> list[str]:
    """Names of the formats this installation can read."""
    return list(NAMES)


def detect(path: str) -> str:
    """The name of the format of `path`, or a FormatError listing what was looked for."""
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    for name, module in READERS:
        if _module(module).detect(path):
            return name
    raise FormatError(f"{path}: not a checkpoint of any known format (known: {', '.join(NAMES)})")


def step_folders(path: str, fmt: str = "auto") -> StepFolders | None:
    """The step folders of `path` when it is an output folder of several steps of format `fmt`
    (`io.step_folders`: names only), else None."""
    mod = _module(dict(READERS)[detect(path) if fmt == "auto" else fmt])
    return mod.steps(path) if hasattr(mod, "steps") else None


def require_store(path: str) -> None:
    """`path` is a folder that may hold our checkpoints (`DIR` or `DIR/<step>`), or a CheckpointError
    saying what it is instead: absent (nothing is created), not a folder, or another format's
    checkpoint, which becomes one of ours by an import. A folder of no known format passes (a
    training loop's store before its first save): the store says it has no steps."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such folder (expected one of our checkpoints: `hybridckpt import` or "
                              f"CheckpointStore writes them)")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a folder (expected one of our checkpoints, a folder)")
    for name, module in READERS:
        if _module(module).detect(path):
            if name == "orbax":
                return
            raise CheckpointError(
                f"{path} is a {name} checkpoint, not a hybridckpt store; import it first: "
                f"hybridckpt.import_checkpoint({str(path)!r}, DST)",
                cli=f"{path} is a {name} checkpoint, not a hybridckpt store; import it first: "
                    f"hybridckpt import {path} DST")


def open_source(path: str, fmt: str = "auto", *, config=None, step: int | None = None,
                verify_reads: bool = True) -> SourceCheckpoint:
    """Open `path` as format `fmt` ("auto" detects it); `config` is a model config for sources
    that carry none; `step` picks a step of a source that holds several (default: the format's:
    the latest, or the one its tracker names), a FormatError listing the steps there when it is
    not one of them; our checkpoint's reads are checked against the CRC-32s of its import unless
    `verify_reads=False`."""
    if fmt == "auto":
        fmt = detect(path)
    modules = dict(READERS)
    if fmt not in modules:
        raise FormatError(f"unknown format {fmt!r} (known: {', '.join(NAMES)})")
    mod = _module(modules[fmt])
    found = mod.steps(path) if step is not None and hasattr(mod, "steps") else None
    if fmt == "orbax":
        src = mod.open(path, config=config, step=step, verify_reads=verify_reads)
        if found is not None and found.folders:
            src = replace(src, notes=(found.note(step), *src.notes))
    elif found is not None:  # one step of several: its own folder, opened as the format opens it
        src = mod.open(found.folder(step), config=config)
        src = replace(src, notes=(found.note(step), *src.notes))
    else:
        src = mod.open(path, config=config)
        if step is not None and src.step != step:
            held = "no step number" if src.step is None else f"step {src.step}"
            raise FormatError(
                f"{path}: no step {step}: this {fmt} checkpoint holds one step ({held}); a step is picked "
                f"from a folder of several (step-N/, checkpoint-N/, iter_N/, global_stepN/, N/)"
            )
    check_shapes(src)
    return checked_steps(src)


def checked_steps(src: SourceCheckpoint) -> SourceCheckpoint:
    """`src` with its step and its optimizer's as ints: a step read from a file (a list, a string,
    2.5, inf) is a FormatError naming the source (`values.integer`), not a traceback later."""
    step = None if src.step is None else values.integer(src.step, src.path, "step")
    opt = src.optimizer
    if opt is not None and opt.step is not None:
        opt = dataclasses.replace(opt, step=values.integer(opt.step, src.path, "optimizer step"))
    return dataclasses.replace(src, step=step, optimizer=opt)


def check_shapes(src: SourceCheckpoint) -> None:
    """Every tensor of `src` (params, optimizer slots, masters) has a shape within the bounds of
    `lazy.shape_problem`: a FormatError naming the tensor otherwise, before anything plans on it."""
    groups = [("tensor", src.tensors)]
    if src.optimizer is not None:
        groups += [(f"{slot} of", t) for slot, t in src.optimizer.slots.items()]
        groups.append(("master weight", src.optimizer.master))
    for what, tensors in groups:
        for name, t in tensors.items():
            problem = shape_problem(tuple(t.shape))
            if problem is not None:
                raise FormatError(f"{src.path}: {what} {short_repr(name)}: {problem}")
