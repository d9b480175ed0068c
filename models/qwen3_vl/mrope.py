"""Multimodal RoPE (M-RoPE) of the Qwen vision-language models: each rotary frequency is turned
by one of three position axes (temporal, height, width), exactly as transformers 5.24 computes it.

Reference: huggingface/transformers:src/transformers/models/qwen3_vl/modeling_qwen3_vl.py
(`Qwen3VLTextRotaryEmbedding.forward` / `recomposition_frequencies`) and
models/qwen2_5_vl/modeling_qwen2_5_vl.py (`Qwen2_5_VLRotaryEmbedding`).

- Positions: `position_ids [3, batch, seq]` int (axis 0 temporal, 1 height, 2 width). A text-only
  prompt has the same position on all three axes (`arange(seq)`), so every frequency turns by
  it and M-RoPE is plain RoPE.
- Angles: `freqs[a, b, s, j] = position_ids[a, b, s] * inv_freq[j]` in fp32, `j < head_dim / 2`,
  inv_freq of the config's rope type (`models.rope.rope_frequencies`); cos and sin times the
  type's attention scaling.
- Which axis turns frequency j (`mrope_axes`), from `mrope_section = (t, h, w)`:
  - interleaved (Qwen3-VL; transformers always interleaves for it, whatever the config's
    `mrope_interleaved` says): j starts on axis 0; j in `range(1, 3 h, 3)` takes axis 1 and j in
    `range(2, 3 w, 3)` axis 2 (Python slices, so clipped to head_dim / 2): T H W T H W ... T T;
  - chunked (Qwen2-VL, Qwen2.5-VL): the first t frequencies axis 0, the next h axis 1, the next
    w axis 2 (`torch.split(mrope_section)`, chunk i from axis i % 3); t + h + w must be
    head_dim / 2.
- The chosen `[batch, seq, head_dim / 2]` angles are repeated over both halves (half-split RoPE,
  `models.llama.module.apply_rope`): cos, sin `[batch, seq, head_dim]`.

`mrope_axes` and the checks are numpy / plain Python (configs stay JAX-free); `mrope_tables`
imports JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.rope import rope_frequencies


def check_section(
    section: Any, head_dim: int, interleaved: bool, where: str
) -> tuple[int, int, int]:
    """`mrope_section` as a tuple of three ints >= 0 that fits `head_dim` (chunked: sums to
    head_dim / 2, as torch.split needs); ConfigError naming `where` otherwise."""
    if (not isinstance(section, Sequence) or isinstance(section, str) or len(section) != 3
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in section)):  # fmt: skip
        raise ConfigError(f"{where}: mrope_section must be three ints >= 0, found {section!r:.80}")
    section = tuple(section)
    if not interleaved and sum(section) != head_dim // 2:
        raise ConfigError(f"{where}: mrope_section {list(section)} sums to {sum(section)}; expected "
                          f"head_dim / 2 = {head_dim // 2}")  # fmt: skip
    return section


def mrope_axes(head_dim: int, section: Sequence[int], interleaved: bool) -> np.ndarray:
    """The position axis (0, 1, 2) turning each of the `head_dim / 2` frequencies (module doc)."""
    half = head_dim // 2
    axes = np.zeros(half, np.int32)
    if interleaved:
        for axis in (1, 2):
            axes[axis : min(section[axis] * 3, half) : 3] = axis
        return axes
    start = 0
    for i, n in enumerate(section):
        axes[start : start + n] = i % 3
        start += n
    return axes


def position_ids_3d(position_ids: Any, batch: int, seq: int) -> Any:
    """`[3, batch, seq]` int positions: None gives `arange(seq)` on every axis (text only), a
    `[batch, seq]` array is repeated on the three axes, a `[3, batch, seq]` one is used as is."""
    import jax.numpy as jnp

    if position_ids is None:
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (3, batch, seq))
    position_ids = jnp.asarray(position_ids)
    if position_ids.shape == (batch, seq):
        return jnp.broadcast_to(position_ids, (3, batch, seq))
    if position_ids.shape != (3, batch, seq):
        raise ConfigError(f"position_ids: expected shape [3, {batch}, {seq}] or [{batch}, {seq}], "
                          f"found {list(position_ids.shape)}")  # fmt: skip
    return position_ids


def mrope_tables(cfg: Any, position_ids: Any) -> tuple[Any, Any]:
    """cos, sin `[batch, seq, head_dim]` fp32 of `position_ids [3, batch, seq]` for a config with
    head_dim, rope_theta, rope_scaling, max_position_embeddings, mrope_section and
    mrope_interleaved (module doc)."""
    import jax.numpy as jnp

    seq = position_ids.shape[-1]
    inv_freq, scaling = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, seq,
                                         max_position_embeddings=cfg.max_position_embeddings)  # fmt: skip
    axes = mrope_axes(cfg.head_dim, cfg.mrope_section, cfg.mrope_interleaved)
    chosen = jnp.take(position_ids, jnp.asarray(axes), axis=0)  # [half, batch, seq]
    angles = jnp.moveaxis(chosen, 0, -1).astype(jnp.float32) * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos, sin
