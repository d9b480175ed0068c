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

from hybridckpt.errors import ConfigError, MappingError


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
    param_order: Any = None,
) -> np.ndarray:
    """The model's logits `[batch, seq, vocab]` (fp32) for int `tokens` `[seq]` or `[batch, seq]`
    (`verify_reads`: a hybridckpt source's chunks checked against their import's CRC-32s)."""
    from hybridckpt import models, naming
    from hybridckpt.jobs.import_ import cast_named
    from hybridckpt.jobs.open import open_checkpoint, require_config

    opened = open_checkpoint(src, fmt, config=config, step=step, verify_reads=verify_reads, param_order=param_order)
    cfg = require_config(opened, "logits")
    import jax  # (only now: a source that cannot be opened is said without loading JAX)
    import jax.numpy as jnp

    from hybridckpt import plan
    from hybridckpt.mesh import as_mesh
    from hybridckpt.place import assemble

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
    jmesh = as_mesh(mesh)
    p = plan.for_model(cfg, jmesh, indivisible="replicate")
    params = assemble(naming.nest(tree.params), p.param_shardings, np.float32)
    cd = jnp.bfloat16 if compute_dtype in ("bfloat16", "bf16") else jnp.float32
    fn = jax.jit(lambda prm, t: models.forward(cfg, prm, t, compute_dtype=cd))
    return np.asarray(fn(params, toks))


def check_out(path: str) -> str:
    """The `--out` file, checked before the forward pass runs: a non-empty path that is not a
    folder, in a folder that exists and can be written; returned as given."""
    where = os.fspath(path)
    if not where:
        raise ConfigError("--out '': expected the path of the .npy file to write")
    if os.path.isdir(where):
        raise ConfigError(f"--out {where}: is a folder; expected the path of the .npy file to write")
    folder = os.path.dirname(where) or "."
    if not os.path.isdir(folder):
        raise ConfigError(f"--out {where}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {where}: the folder {folder} is not writable")
    return where


def save(path: str, out: np.ndarray) -> str:
    """Write `out` as a `.npy` file at exactly `path` (no suffix added) and return it: written
    into a temporary sibling (removed on any failure or Ctrl-C) and renamed into place, so the
    path holds the whole array or what it held before. A file already there is replaced."""
    import secrets

    from hybridckpt.io import interrupts

    where = check_out(path)
    folder = os.path.dirname(where) or "."
    tmp = os.path.join(folder, f".{os.path.basename(where)}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for np.save
    except OSError as e:
        raise ConfigError(f"--out {where}: cannot write in {folder} ({e.strerror})") from None
    interrupts.add_temporary(tmp, "file")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, out, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        with interrupts.committing():
            os.replace(tmp, where)
    except OSError as e:
        raise ConfigError(f"--out {where}: cannot write the logits ({e.strerror or e})") from None
    finally:
        interrupts.discard_temporary(tmp)
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return where
