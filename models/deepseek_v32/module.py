"""DeepSeek V3.2 in Flax linen, numerically like transformers' DeepseekV32ForCausalLM (5.24).

DeepSeek V3's module (`models.deepseek_v3.module`: MLA, the MoE and dense MLP groups, MTP params)
with one change per decoder layer: MLA's attention sees only the keys the lightning indexer
(`models.deepseek_v32.indexer`) selects for each query, from the layer's normed input and MLA's
normed q latent. Everything else, RoPE tables included, is V3's.
"""

from __future__ import annotations

from typing import Any

import jax

from hybridckpt.models.deepseek_v3.module import MTP, DecoderLayer, DeepseekV3, mla
from hybridckpt.models.deepseek_v32.indexer import Indexer


def indexed_mla(cfg: Any, dt: Any, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """MLA of the normed `x` whose keys are the indexer's selection (inside the layer's compact
    method: `indexer` is its child)."""
    indexer = Indexer(cfg, dt, name="indexer")
    return mla(cfg, dt, x, cos, sin, select=lambda q_latent: indexer(x, q_latent, cos, sin))


class IndexedDecoderLayer(DecoderLayer):
    """DeepSeek V3's decoder layer with the indexer's selection in its attention."""

    attend = staticmethod(indexed_mla)


class IndexedMTP(MTP):
    """DeepSeek V3's MTP params with V3.2's decoder layer (its indexer included)."""

    layer_cls = IndexedDecoderLayer


class DeepseekV32(DeepseekV3):
    """tokens `[batch, seq]` int -> logits `[batch, seq, vocab]` float32."""

    layer_cls = IndexedDecoderLayer
    mtp_cls = IndexedMTP
