"""Format importers: each module turns a folder or file into a `SourceCheckpoint`.

A format module defines `NAME` (str), `detect(path: str) -> bool` (cheap: file names and a few
bytes), and `open(path: str, *, config=None) -> SourceCheckpoint` (pure planning from metadata; no
tensor bytes read). `FORMATS` lists them in detection order.
"""

from __future__ import annotations

import importlib
import os

from hybridckpt.errors import FormatError, short_repr
from hybridckpt.lazy import shape_problem
from hybridckpt.source import SourceCheckpoint

# module names under hybridckpt.formats (or full module paths), in detection order (most
# specific first); our own checkpoints are a source too (`hybridckpt.store.source`)
FORMATS = (
    "hybridckpt.store.source",
    "megatron",
    "meta_llama",
    "megatron_dist",  # before dcp: a torch_dist folder is a DCP folder too
    "flex_checkpoint",  # Paddle's {id}.metadata + {rank}_{id}.distcp (not DCP's .metadata)
    "dcp",
    "deepspeed",
    "paddle",
    "hybridckpt.formats.paddle.unified",
    "colossal",
    "hf",
)


def _module(name: str):
    full = name if "." in name else f"hybridckpt.formats.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            return None
        raise


def available() -> list[str]:
    """Names of the formats this installation can read."""
    return [m.NAME for m in (_module(n) for n in FORMATS) if m is not None]


def detect(path: str) -> str:
    """The name of the format of `path`, or a FormatError listing what was looked for."""
    if not os.path.exists(path):
        raise FormatError(f"{path}: no such file or directory")
    for name in FORMATS:
        mod = _module(name)
        if mod is not None and mod.detect(path):
            return mod.NAME
    raise FormatError(
        f"{path}: not a checkpoint of any known format (known: {', '.join(available())})"
    )


def open_source(path: str, fmt: str = "auto", *, config=None, step: int | None = None,
                verify_reads: bool = True) -> SourceCheckpoint:
    """Open `path` as format `fmt` ("auto" detects it); `config` is a model config for sources
    that carry none; `step` picks a step of a source that holds several (ours), whose reads are
    checked against the CRC-32s of its import unless `verify_reads=False`."""
    if fmt == "auto":
        fmt = detect(path)
    for name in FORMATS:
        mod = _module(name)
        if mod is not None and mod.NAME == fmt:
            if mod.NAME == "orbax":
                src = mod.open(path, config=config, step=step, verify_reads=verify_reads)
            else:
                src = mod.open(path, config=config, step=step) if step is not None else mod.open(path, config=config)
            check_shapes(src)
            return src
    raise FormatError(f"unknown format {fmt!r} (known: {', '.join(available())})")


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
