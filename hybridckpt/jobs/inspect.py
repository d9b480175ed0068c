"""The inspect job: what a checkpoint holds, from its metadata alone (no tensor bytes read).

Format, topology, step, the model config (or that one is needed for a model-level job), the
optimizer (which one, by its slots; how many params have state; master weights), the config and
tokenizer files, and every tensor under the source's own names with its global shape, dtype and
number of stored pieces. A source of a model the project does not know is listed all the same.
Every format answers in one schema (`SCHEMA`: the keys, in order, that `inspect --json` prints).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hybridckpt.io.gc_pause import gc_paused
from hybridckpt.lazy import LazyTensor, StoredTensor

SCHEMA_VERSION = 1
# `inspect --json`: the same keys for every format, in this order (docs/cli.md "inspect --json")
SCHEMA = {
    "schema": "the version of this schema (1)",
    "format": "the format name (`--format` choices; `orbax` for ours)",
    "path": "the absolute path inspected",
    "step": "the training step, or null when the checkpoint does not say",
    "steps": "every step the folder holds (ours, torchtitan step-N/, Trainer checkpoint-N/, Megatron iter_N/, "
             "DeepSpeed global_stepN/, MaxText N/: each step folder's number; a source of one step: [step] or [])",
    "default_step": "the step read when none is asked for (the latest, or the one the source's tracker names), "
                    "or null",
    "topology": "parallel degrees read from the files, e.g. {\"tp\": 2, \"pp\": 2}; ours: the mesh it was saved on",
    "config": "the model config: {\"family\", ...fields} (RoPE scaling as an object), or null",
    "needs_config": "true when model-level jobs (logits, import as a model) need --config",
    "architecture": "the architecture config.json names when no family implements it, else null",
    "quantization": "a quantized release's {\"quant_method\" (fp8, mxfp4), ...} (dequantized on import), else null",
    "optimizer": "null, or {\"name\" (adamw, sgd, or null: undeclared), \"step\", \"slots\" (the "
                 "framework's slot names), \"params_with_state\" (tensors with state; ours: stored arrays), "
                 "\"master_weights\" (fp32 masters kept apart), \"hyper\" (lr, betas, eps, weight_decay, "
                 "... as the source recorded them, or {}), \"param_groups\" ([{hyper-parameters of the "
                 "group, \"params\": how many}])}",
    "files": "config, generation config and tokenizer files that travel with the weights (names)",
    "notes": "remarks (strings)",
    "trainer_state": "ours: the saved trainer state (checksums left out); others: null",
    "tensors": "[{\"name\", \"shape\", \"dtype\", \"pieces\"}]: every tensor (ours: the stored arrays, "
               "Flax tree names) with its global shape and how many stored pieces it is made of",
}


def _pieces(t: LazyTensor, seen: dict | None = None) -> int:
    """How many stored pieces a lazy tensor is made of. `seen` (id of a tensor -> its count, the
    tensor kept alive beside it) is shared across one summary: views of one stored tensor (the
    per-expert views of a grouped MoE tensor: 256 a tensor) count its chunks once, not once each."""
    if isinstance(t, StoredTensor):
        return 1
    if seen is not None:
        got = seen.get(id(t))
        if got is not None:
            return got[0]
    if hasattr(t, "stored_pieces"):  # a DCP tensor over its chunk table
        n = t.stored_pieces()
    else:
        kids = [getattr(t, a) for a in ("src", "stored", "flat") if isinstance(getattr(t, a, None), LazyTensor)]
        kids += list(getattr(t, "parts", ()) or ())
        kids += [block for _, block in getattr(t, "pieces", ()) or ()]  # tiled `(offsets, block)`s (DCP)
        n = sum(_pieces(k, seen) for k in kids) if kids else 1
    if seen is not None:
        seen[id(t)] = (n, t)  # (the tensor kept: its id is not reused while `seen` lives)
    return n


@gc_paused()  # a row dict a tensor (10^5 on a DeepSeek V3 source), no cycles: `io.gc_pause`
def inspect(path: str | os.PathLike, fmt: str = "auto", *, config: Any = None, step: int | None = None,
            param_order: Any = None) -> dict:
    """What a checkpoint holds, as a JSON-able dict of one schema for every format (`SCHEMA`;
    docs/cli.md "inspect --json"); reads metadata only."""
    from hybridckpt.formats import orbax_store as store_source
    from hybridckpt.formats import registry
    from hybridckpt.io.paths import given
    from hybridckpt.io.remote.view import local_path, shown

    path = os.path.abspath(local_path(given(path, "the source")))  # a URL: its local view
    fmt = registry.detect(path) if fmt == "auto" else fmt
    if fmt == store_source.NAME:
        registry.store_view(shown(path))  # our store in a bucket: its commit marker, before a read
        info = {**store_source.describe(path, step), "path": shown(path)}
        held = store_source.steps(path)
        notes = [held.note(step)] if step is not None and held is not None and held.folders else []
        return _in_order({**info, "notes": notes + info["notes"], "default_step": max(info["steps"]) if info["steps"]
                          and store_source.root_and_step(path)[1] is None else info["step"]})
    src = registry.open_source(path, fmt, config=config, step=step, param_order=param_order)
    held = registry.step_folders(path, fmt)  # (an index-keyed optimizer's naming and why: a note)
    cfg, files = src.config, src.files
    info: dict[str, Any] = {
        "format": src.format,
        "path": shown(path),
        "step": src.step,
        "steps": held.steps if held is not None else [] if src.step is None else [src.step],
        "default_step": held.default if held is not None else src.step,
        "topology": dict(src.topology),
        "config": None,
        "needs_config": cfg is None,
        "optimizer": None,
        "files": sorted(files),
        "notes": list(src.notes),
        "trainer_state": None,
        "tensors": _tensors(src.tensors),
    }
    if "quantization" in src.trainer:
        info["quantization"] = dict(src.trainer["quantization"])
    raw = src.trainer.get("hf_config") if cfg is None else None
    if raw is not None:
        from hybridckpt.formats.hf import architecture

        info["architecture"] = architecture(raw)
        info["needs_config"] = False  # config.json is there: its architecture is what is missing
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
            "hyper": {k: v for k, v in opt.hyper.items() if k != "groups"},
            "param_groups": [dict(g) for g in opt.groups] or [
                {**{k: v for k, v in g.items() if k != "params"}, "params": len(g.get("params") or [])}
                for g in opt.hyper.get("groups") or []
            ],
        }
    return _in_order(info)


def _tensors(tensors: dict) -> list[dict]:
    """The summary's tensor rows: name, global shape, dtype and stored pieces (`_pieces`, one
    count per stored tensor however many views of it are listed)."""
    seen: dict = {}
    names: dict = {}  # dtype -> its name (a few dtypes for tens of thousands of tensors)
    out = []
    for k, t in tensors.items():
        dt = names.get(t.dtype)
        if dt is None:
            dt = names[t.dtype] = str(np.dtype(t.dtype))
        out.append({"name": k, "shape": list(t.shape), "dtype": dt, "pieces": _pieces(t, seen)})
    return out


def _in_order(info: dict) -> dict:
    """`info` under exactly the keys of `SCHEMA`, in its order (null where a format has nothing to
    say), with the schema's version."""
    return {k: SCHEMA_VERSION if k == "schema" else info.get(k) for k in SCHEMA}
