"""DeepSeek V3.2's lightning indexer: which keys each query's MLA attention may see.

Exactly transformers' `DeepseekV32Indexer.forward` and the mask `DeepseekV32Attention.forward`
folds it into (huggingface/transformers:src/transformers/models/deepseek_v32/
modular_deepseek_v32.py, 5.24; DeepSeek's inference/model.py `Indexer`, whose Hadamard rotation
keeps dot products and whose FP8 scoring is a precision choice, both left out as transformers
does). For the normed input x `[b, s, E]` and MLA's normed q latent `[b, s, QL]`:
1. q = wq_b(q latent) `[b, s, IH, ID]`; k = LayerNorm(wk(x)) `[b, s, ID]` (eps 1e-6, with bias),
   one key shared by every index head.
2. RoPE on the FIRST `qk_rope_head_dim` values of each (q and k: `[rope | pass]`, unlike MLA's
   `[nope | rope]`), half-split (Llama's rotate_half, `models.llama.module.apply_rope`) while
   MLA's is interleaved; the same cos/sin tables as MLA (yarn's attention factor included).
3. scores = ReLU(q . k * ID**-0.5) `[b, s, IH, t]` (fp32); per-head weights
   weights_proj(x) * IH**-0.5 `[b, s, IH]`, computed in fp32 whatever the compute dtype
   (transformers keeps `weights_proj` fp32: `_keep_in_fp32_modules`); index score = the weighted
   sum over heads `[b, s, t]`.
4. Causal keys only; the `min(index_topk, s)` best are selected (`jax.lax.top_k`: ties to the
   lower index; torch's topk leaves the order of equal scores unspecified, which matters only
   for exactly equal scores, e.g. several keys whose every head's score is cut to 0 by the ReLU
   at the edge of the top k). Returned as bool `[b, s, s]`; attention sees a key only when it is
   causal AND selected (a query with fewer than `index_topk` causal keys sees them all).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.nn import relu

from hybridckpt.models.common import Dense
from hybridckpt.models.gpt2.module import layer_norm
from hybridckpt.models.llama.module import apply_rope

K_NORM_EPS = 1e-6  # DeepseekV32Indexer's nn.LayerNorm(index_head_dim, eps=1e-6)


class Indexer(nn.Module):
    """The indexer's params (`indexer.*` of a decoder layer) and its selection (module doc)."""

    cfg: Any  # a DeepseekV32Config
    dtype: Any

    @nn.compact
    def __call__(
        self, x: jax.Array, q_latent: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        b, s, _ = x.shape
        IH, ID, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        q = Dense(dt, name="wq_b")(q_latent).reshape(b, s, IH, ID)
        k = layer_norm(K_NORM_EPS, dt, "k_norm")(Dense(dt, name="wk")(x))[:, :, None]
        q = jnp.concatenate([apply_rope(q[..., :R], cos, sin), q[..., R:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :R], cos, sin), k[..., R:]], axis=-1)[:, :, 0]
        scores = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = relu(scores * ID**-0.5)
        weights = Dense(jnp.float32, name="weights_proj")(x.astype(jnp.float32)) * IH**-0.5
        index = jnp.einsum("bsh,bsht->bst", weights, scores)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        index = jnp.where(causal, index, -jnp.inf)
        chosen = jax.lax.top_k(index, min(cfg.index_topk, s))[1]  # [b, s, k]
        selected = jnp.zeros((b, s, s), dtype=bool)
        selected = selected.at[
            jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], chosen
        ].set(True)
        return selected & causal
