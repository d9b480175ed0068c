"""hybridckpt: training checkpoints between parallel layouts and frameworks, as sharded JAX arrays.

The public API (each has a docstring; the README shows each in use):

    open_checkpoint(path)                   any checkpoint as HF-named lazy tensors + optimizer slots
    import_checkpoint(src, dst, mesh=...)   into an Orbax checkpoint sharded on a mesh, streamed
    export_checkpoint(src, out, **ExportJob) to any format a writer offers (HF by default), streamed
    restore(directory, mesh)                one of our checkpoints onto any mesh, with its optimizer
    verify(a, b) / verify_checksums(path)   compare two checkpoints / re-check ours on disk
    inspect(path) / logits(path, tokens)    what a checkpoint holds / its forward pass
    make_mesh(dp=, fsdp=, tp=, pp=)         a ("dp", "fsdp", "tp", "pp") mesh
    CheckpointStore(directory)              Orbax CheckpointManager for training loops

Every name is imported on first use (JAX only by the names that need it, so torch-side
conversions never load it): `import hybridckpt` itself costs a few milliseconds, which is also what
lets the command line install its Ctrl-C handler before anything else runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_WHERE = {
    "HybridCkptError": "hybridckpt.errors",
    "open_checkpoint": "hybridckpt.jobs.open",
    "import_checkpoint": "hybridckpt.jobs.import_",
    "export_checkpoint": "hybridckpt.jobs.export",
    "ExportJob": "hybridckpt.jobs.export",
    "verify": "hybridckpt.jobs.verify",
    "verify_checksums": "hybridckpt.jobs.verify",
    "inspect": "hybridckpt.jobs.inspect",
    "logits": "hybridckpt.jobs.logits",
    "restore": "hybridckpt.jobs.restore",
    "CheckpointStore": "hybridckpt.store.manager",
    "make_mesh": "hybridckpt.mesh",
    "MeshShape": "hybridckpt.mesh",
}

__all__ = ["__version__", *sorted(_WHERE)]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'hybridckpt' has no attribute {name!r}")
