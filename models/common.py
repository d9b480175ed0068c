"""Pieces shared by the model families: params created from the family's table, the dense,
embedding and norm layers that read them, scanned layer stacks, causal attention, the next-token
loss, and the helpers that turn a Flax module into plain pytrees.

Every param is created by `table_param` from its row of the family's table (`models.table`,
`Family.specs`): the row at the module's path plus the param's name ("layers.q.kernel") gives
the shape, the logical axes and the init; module code declares none of them. Params are fp32 and
boxed with their logical axis names (`nn.with_logical_partitioning`). A block run by `stacked`
(`nn.scan` over the layers) creates one layer's slice: the scan stacks it on the leading axis the
table gives (named by the scan's `axis`, "layers" unless said). The public functions return
plain nested dicts: `unboxed` drops the boxes, `axes_of` keeps only their names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen.dtypes import promote_dtype

from hybridckpt.models.errors import ConfigError
from hybridckpt.models.family import family_of
from hybridckpt.models.table import Spec

Axes = tuple[str | None, ...]
INIT_STD = 0.02  # normal init std of kernels and embeddings (HF `initializer_range`)


def normal(axes: Axes) -> Callable:
    return nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), axes)


def ones(axes: Axes) -> Callable:
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def zeros(axes: Axes) -> Callable:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


_INITS = {"normal": normal, "ones": ones, "zeros": zeros}


# -------------------------------------------------------------------------- params from the table


def _model_of(mod: nn.Module) -> tuple[Any, int]:
    """The config of the model `mod` is part of (the nearest module with a `cfg` field, itself
    or a parent) and the number of leading axes a `stacked` scan around it adds (0 or 1)."""
    cfg, lead, m = None, 0, mod
    while isinstance(m, nn.Module):
        if cfg is None and "cfg" in getattr(type(m), "__dataclass_fields__", {}):
            cfg = m.cfg
        lead += getattr(type(m), "scan_axes", 0)
        m = m.parent
    if cfg is None:
        raise ConfigError(f"{'/'.join(mod.scope.path)}: no enclosing module has a model config")
    return cfg, lead


def _spec(mod: nn.Module, path: str) -> tuple[Spec | None, int, str]:
    """(the spec of `path` under `mod`, or None, the scan's leading axes, the full path)."""
    cfg, lead = _model_of(mod)
    full = ".".join((*mod.scope.path, path))
    return family_of(cfg).specs(cfg).get(full), lead, full


def has_param(mod: nn.Module, path: str) -> bool:
    """The family's table has a param at `mod`'s path plus `path` for this config."""
    return _spec(mod, path)[0] is not None


def table_param(mod: nn.Module, name: str, computed: tuple[int, ...] | None = None) -> jax.Array:
    """`mod.param(name)` with the shape, logical axes and init of its table row (inside a
    `stacked` block: one layer's slice). `computed`: the shape a Flax layer derives from its
    input, which must be the table's."""
    spec, lead, full = _spec(mod, name)
    if spec is None:
        origin = family_of(_model_of(mod)[0]).table.source
        raise ConfigError(f"{origin}: the module creates {full!r}, a param the table does not have for this config")
    shape, axes = spec.shape[lead:], spec.axes[lead:]
    if computed is not None and tuple(computed) != shape:
        origin = family_of(_model_of(mod)[0]).table.source
        raise ConfigError(f"{origin}: {full} is {shape} in the table, the module computes {tuple(computed)}")
    return nn.Module.param(mod, name, _INITS[spec.init](axes), shape, jnp.float32)


class Dense(nn.Module):
    """`x @ kernel (+ bias)` over x's last axis, as `nn.DenseGeneral` computes it (operands
    promoted to `dtype`); kernel `[in, *out]` and the bias (when the table has one) from the table."""

    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = table_param(self, "kernel")
        bias = table_param(self, "bias") if has_param(self, "bias") else None
        x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=None)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (x.ndim - 1) + kernel.shape[1:])
        return y


class Embed(nn.Module):
    """A token embedding `[vocab, embed]` from the table, looked up (and `attend`ed) in `dtype`
    as `nn.Embed` does."""

    dtype: Any

    def setup(self) -> None:
        self.embedding = table_param(self, "embedding")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        (embedding,) = promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        if embedding.shape[0] == 1:
            return jnp.broadcast_to(embedding, tokens.shape + embedding.shape[1:])
        return jnp.take(embedding, tokens, axis=0)

    def attend(self, query: jax.Array) -> jax.Array:
        """`query @ embedding.T`: logits of a head tied to the embedding."""
        query, embedding = promote_dtype(query, self.embedding, dtype=self.dtype)
        return jnp.dot(query, embedding.T)


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` whose scale and bias are created from the table (shapes checked)."""

    @nn.nowrap
    def param(self, name: str, init_fn: Any, *init_args: Any, **kwargs: Any) -> jax.Array:
        return table_param(self, name, init_args[0] if init_args else None)


def table_params(mod: nn.Module, skip: tuple[str, ...] = ()) -> dict:
    """Creates every param of the table under `mod`'s path but the children `skip` (call it in
    `mod`'s compact method): nested dicts of arrays, each whole (a group outside the layer scan)."""
    cfg, _ = _model_of(mod)
    prefix = ".".join(mod.scope.path) + "."
    children: dict[str, bool] = {}  # child name -> is a param (else a subgroup)
    for path in family_of(cfg).specs(cfg):
        if path.startswith(prefix):
            rest = path[len(prefix) :]
            children.setdefault(rest.split(".")[0], "." not in rest)
    return {
        name: table_param(mod, name) if leaf else TableGroup(name=name)()
        for name, leaf in children.items()
        if name not in skip
    }


class TableGroup(nn.Module):
    """Creates every param of the table under its path (`table_params`): a group outside the
    layer scan, e.g. the MoE groups of `models.moe`."""

    @nn.compact
    def __call__(self) -> dict:
        return table_params(self)


def output_logits(x: jax.Array, embed: Embed, tied: bool, dtype: Any) -> jax.Array:
    """Logits `[batch, seq, vocab]` of the final hidden states `x`: the embedding's transpose
    when `tied`, else an `lm_head` Dense (kernel `[embed, vocab]`) of the calling module, in
    `dtype`."""
    if tied:
        return embed.attend(x)
    return Dense(dtype, name="lm_head")(x)


@functools.cache
def _scanned(block: type[nn.Module]) -> type[nn.Module]:
    """`block` marked as run by a scan: its params are one layer's slice of the table's."""
    return type(block.__name__, (block,), {"scan_axes": 1, "__module__": block.__module__})


def stacked(
    block: type[nn.Module],
    num_layers: int,
    n_broadcast: int,
    n_per_layer: int = 0,
    axis: str | None = "layers",
) -> type[nn.Module]:
    """`block` (called as `block(x, *broadcast, *per_layer) -> (x, None)`) scanned over
    `num_layers` layers, its params stacked on a leading axis with logical name `axis`.

    The `n_per_layer` last inputs are arrays with a leading `[num_layers]` axis: layer i sees
    row i (data that differs per layer, e.g. which attention kind a layer uses)."""
    return nn.scan(
        _scanned(block),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,) * n_broadcast + (0,) * n_per_layer,
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: axis},
    )


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    scale: float,
    *,
    softcap: float | None = None,
    window: jax.Array | int | None = None,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention. q, k, v: `[batch, seq, heads, head_dim]` (same head count).

    Scores and softmax are fp32 (transformers' eager attention); probabilities are cast back to
    v's dtype before the value product. Returns `[batch, seq, heads, head_dim]` in v's dtype.

    softcap: scores (after `scale`) become `tanh(scores / softcap) * softcap` before the mask
    (Gemma 2's `attn_logit_softcapping`, transformers' `eager_attention_forward`).
    window: query i sees keys j with `i - window < j <= i` (transformers' masking_utils
    `sliding_window_overlay`); may be a traced scalar, so the window can be per-layer data.
    keep: bool `[batch, seq, seq]`, the keys each query may also see beyond the causal mask
    (DeepSeek V3.2's indexer selection); masked keys get fp32 min, as the causal ones.
    """
    seq = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    if window is not None:
        pos = jnp.arange(seq)
        mask = mask & (pos[None, :] > pos[:, None] - window)
    if keep is not None:
        mask = mask[None, None] & keep[:, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def next_token_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy (fp32, nats) of predicting tokens[:, 1:] from logits[:, :-1]."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    ).mean()


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.LogicallyPartitioned)


def _plain(tree: Any) -> Any:
    """Nested Mapping -> nested plain dict (Flax may hand back FrozenDicts)."""
    if hasattr(tree, "items") and not _is_box(tree):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def unboxed(variables: Any) -> dict:
    """The `params` collection as plain nested dicts of arrays, boxes removed."""
    return _plain(nn.meta.unbox(variables["params"]))


def axes_of(variables: Any) -> dict:
    """The `params` collection as plain nested dicts of logical-axis tuples."""
    names = jax.tree.map(lambda b: tuple(b.names), variables["params"], is_leaf=_is_box)
    return _plain(names)
