"""The inspect job: what a checkpoint holds, from its metadata alone (no tensor bytes read).

Format, topology, step, the model config (or that one is needed for a model-level job), the
optimizer (which one, by its slots; how many params have state; master weights), and every
tensor under the source's own names with its global shape, dtype and number of stored pieces.
A source of a model the project does not know is listed all the same.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hybridckpt.lazy import LazyTensor


def _pieces(t: LazyTensor) -> int:
    """How many stored pieces a lazy tensor is made of."""
    from hybridckpt import lazy

    if isinstance(t, lazy.StoredTensor):
        return 1
    if hasattr(t, "stored_pieces"):  # a DCP tensor over its chunk table
        return t.stored_pieces()
    kids = [getattr(t, a) for a in ("src", "stored", "flat") if isinstance(getattr(t, a, None), LazyTensor)]
    kids += list(getattr(t, "parts", ()) or ())
    kids += [block for _, block in getattr(t, "pieces", ()) or ()]  # tiled `(offsets, block)`s (DCP)
    return sum(_pieces(k) for k in kids) if kids else 1


def inspect(path: str | os.PathLike, fmt: str = "auto", *, config: Any = None, step: int | None = None) -> dict:
    """Format, topology, step, config and tensors (name, global shape, dtype, pieces) of a
    checkpoint, as a JSON-able dict."""
    from hybridckpt import readers
    from hybridckpt.jobs.open import _config_arg
    from hybridckpt.store import as_source as store_source

    path = os.path.abspath(os.fspath(path))
    fmt = readers.detect(path) if fmt == "auto" else fmt
    if fmt == store_source.NAME:
        return store_source.describe(path, step)
    cfg = _config_arg(config)
    src = readers.open_source(path, fmt, config=cfg)
    cfg = cfg or src.config
    info: dict[str, Any] = {
        "format": src.format,
        "path": path,
        "step": src.step,
        "topology": dict(src.topology),
        "config": None,
        "needs_config": cfg is None,
        "tensors": [
            {"name": k, "shape": list(t.shape), "dtype": str(np.dtype(t.dtype)), "pieces": _pieces(t)}
            for k, t in src.tensors.items()
        ],
        "optimizer": None,
        "notes": list(src.notes),
    }
    if cfg is not None:
        from hybridckpt import models

        info["config"] = models.config_to_dict(cfg)
    if src.optimizer:
        from hybridckpt.errors import HybridCkptError

        opt = src.optimizer
        try:
            name = opt.optimizer.name
        except HybridCkptError:
            name = None  # per-parameter state of an optimizer we do not declare: listed all the same
        info["optimizer"] = {
            "name": name,
            "step": opt.step,
            "slots": sorted(opt.slots),
            "params_with_state": opt.num_params(),
            "master_weights": len(opt.master),
        }
    return info
