"""Phi-3's RoPE tables: partial rotary and longrope, as transformers computes them (no JAX but in
`rope_tables`).

From huggingface/transformers:src/transformers/modeling_rope_utils.py
`_compute_longrope_parameters` and `longrope_frequency_update`, and
`Phi3RotaryEmbedding.compute_default_rope_parameters`:
- rotary dims d = int(head_dim * partial_rotary_factor); default inv_freq =
  1 / theta ** (arange(0, d, 2) / d) (fp32);
- longrope: ext = `long_factor` when the forward's length exceeds
  `original_max_position_embeddings`, else `short_factor`; inv_freq = 1 / (ext * theta **
  (arange(0, d, 2) / d)); cos and sin times `attention_factor`, which defaults to
  sqrt(1 + ln(factor) / ln(original)) for factor > 1 (else 1), factor defaulting to
  max_position_embeddings / original.
transformers picks the long or short set from the largest position of the call; this module is
stateless and uses the forward's own length, as `models.rope` does for `dynamic`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hybridckpt.models.rope import _default_inv_freq, _pow, _rcp, thaw


def frequencies(cfg: Any, seq: int) -> tuple[np.ndarray, float]:
    """(inv_freq `[rotary_dim / 2]` fp32, attention factor) of a Phi3Config for a forward of
    `seq` positions."""
    dim, theta = cfg.rotary_dim, cfg.rope_theta
    d = thaw(cfg.longrope)
    if d is None:
        return _default_inv_freq(theta, dim), 1.0
    original = cfg.original_max_position_embeddings
    factor = d.get("factor")
    if factor is None:
        factor = cfg.max_position_embeddings / original
    attention = d.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = np.asarray(d["long_factor"] if seq > original else d["short_factor"], np.float32)
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return _rcp((ext * _pow(theta, exponent)).astype(np.float32)), float(attention)


def rope_tables(cfg: Any, seq: int) -> tuple[Any, Any]:
    """cos, sin `[seq, rotary_dim]` fp32 for positions 0..seq-1 (angles repeated over halves),
    times the attention factor."""
    import jax.numpy as jnp

    inv_freq, attention = frequencies(cfg, seq)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos, sin
