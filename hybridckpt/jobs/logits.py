"""The logits job: a checkpoint's forward pass on a mesh, to check a conversion against the
source framework's own forward pass.

Opened (`jobs.open`), renamed to the Flax tree, placed on the mesh by the sharding plan (a
dimension the mesh cannot divide is replicated: this job only computes) and run through the
family's Flax module (`models.forward`), jitted; logits come back as fp32 `[batch, seq, vocab]`.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hybridckpt.errors import MappingError


def logits(
    src: str | os.PathLike,
    tokens: list[int] | np.ndarray,
    *,
    mesh: Any = "dp=1",
    config: Any = None,
    fmt: str = "auto",
    step: int | None = None,
    compute_dtype: str = "float32",
    verify_reads: bool = True,
) -> np.ndarray:
    """The model's logits `[batch, seq, vocab]` (fp32) for int `tokens` `[seq]` or `[batch, seq]`
    (`verify_reads`: a hybridckpt source's chunks checked against their import's CRC-32s)."""
    import jax
    import jax.numpy as jnp

    from hybridckpt import models, naming, plan
    from hybridckpt.jobs.import_ import cast_named
    from hybridckpt.jobs.open import open_checkpoint, require_config
    from hybridckpt.mesh import MeshShape, mesh_from_shape
    from hybridckpt.place import assemble

    opened = open_checkpoint(src, fmt, config=config, step=step, verify_reads=verify_reads)
    cfg = require_config(opened, "logits")
    toks = np.asarray(tokens, dtype=np.int32)
    if toks.ndim == 1:
        toks = toks[None]
    if toks.size == 0 or toks.ndim != 2:
        raise MappingError(f"tokens: expected a non-empty [seq] or [batch, seq] of ids, found shape {toks.shape}")
    vocab = models.rule_variables(cfg)["vocab_size"]
    if toks.min() < 0 or toks.max() >= vocab:
        raise MappingError(f"tokens must lie in [0, {vocab}), found {toks.min()}..{toks.max()}")
    hf, _ = cast_named(opened.named, "float32")  # (a dequantized tensor: its exact float32 values)
    tree = naming.hf_to_tree(hf, cfg)
    jmesh = mesh if isinstance(mesh, jax.sharding.Mesh) else mesh_from_shape(
        MeshShape.parse(mesh) if isinstance(mesh, str) else mesh
    )
    p = plan.for_model(cfg, jmesh, indivisible="replicate")
    params = assemble(naming.nest(tree.params), p.param_shardings, np.float32)
    cd = jnp.bfloat16 if compute_dtype in ("bfloat16", "bf16") else jnp.float32
    fn = jax.jit(lambda prm, t: models.forward(cfg, prm, t, compute_dtype=cd))
    return np.asarray(fn(params, toks))
