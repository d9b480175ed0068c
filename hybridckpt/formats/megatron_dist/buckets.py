"""The distributed optimizer's `dp_reshardable` state: per-bucket 1-D tensors back to parameters.

Keys (NVIDIA/Megatron-LM:megatron/core/optimizer/distrib_optimizer.py
`sharded_param_state_dp_reshardable`; `fully_sharded_bucket_space` in core <= 0.12):
`[chained_{i}.]optimizer.distributed.dp_group_idx_{g}.gbuf_idx_{b}.dtype_{(param_dtype,
grad_dtype)}.bucket_idx_{k}.{param|exp_avg|exp_avg_sq}`, each a 1-D fp32 tensor of the bucket's
`numel_unpadded` elements, the DP ranks' shards at their offsets. `param` is the fp32 master.

What it does not store is which parameter lies where; it is rebuilt here:
- `g` is the model-parallel rank, `tp_rank + tp * pp_rank` (optimizer/__init__.py
  `data_parallel_group_idx=model_parallel_rank`; parallel_state.py
  `generate_masked_orthogonal_rank_groups`, the `tp-pp` group), so each g is one (tp, pp) domain
  holding that rank's LOCAL (tensor-parallel) shards.
- `b` is the grad buffer: one per model chunk (virtual pipeline stage) while one dtype is used.
- A buffer holds the chunk's trainable params in REVERSE `named_parameters()` order, each start
  padded to a multiple of 64 elements, cut into buckets (optimizer/distrib_optimizer.py
  `_compute_per_buffer_param_layout`, optimizer/param_layout.py `pad_param_start`); a bucket's
  `numel_unpadded` ends at its last param's end (or at the padded start of a `shared_embedding`
  param, which gets a bucket of its own). Walking the params with the stored bucket sizes gives
  each one's bucket and offset; sizes that do not add up are a FormatError naming the key.
- `named_parameters()` of a GPT model chunk (models/gpt/gpt_model.py): the embedding (first
  stage, first chunk), the layers in order, `decoder.final_layernorm`, then `output_layer`
  (last stage, last chunk; with tied embeddings and PP > 1 too, as the shared copy). Inside a
  layer (`LAYER_ORDER`): transformer_layer.py builds input_layernorm, self_attention,
  pre_mlp_layernorm, mlp; attention.py `linear_proj` before `linear_qkv`, then `q_layernorm`,
  `k_layernorm`; TE's LayerNormLinear registers `layer_norm_weight`/`_bias` before `weight`/
  `bias` (NVIDIA/TransformerEngine:transformer_engine/pytorch/module/layernorm_linear.py). With
  the local spec (`args.transformer_impl == "local"`) the norms are modules of their own,
  `input_layernorm` and `pre_mlp_layernorm`, registered before the attention and before the MLP
  (the MoE layer's router included), which its `sharded_state_dict_keys_map` saves under TE's
  fused names `self_attention.linear_qkv.layer_norm_*` and `mlp.linear_fc1.layer_norm_*`
  (models/gpt/gpt_layer_specs.py `get_gpt_layer_local_submodules`; megatron-core 0.19.2 lays a
  MoE layer out so, tests/real/cases/megatron_core_moe_*).
- Layers of chunk v on pipeline rank p: `v * L / vpp + p * L / (pp * vpp)` onwards
  (transformer_block.py `get_transformer_layer_offset`, even split).
Each rank's views are joined across tensor-parallel ranks by `rules/megatron_tp.rules`, as the
legacy `distrib_optim.pt` reader does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from hybridckpt import lazy
from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron.experts import is_buffer
from hybridckpt.formats.megatron.layout import Topology
from hybridckpt.formats.megatron.model import merge_tp
from hybridckpt.formats.megatron_dist.expert_buckets import (
    ExpertLayout,
    expert_params,
    with_inline_experts,
)
from hybridckpt.lazy import LazyTensor
from hybridckpt.rules import RuleSet

BUCKET = re.compile(
    r"^(?P<chain>chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(?P<g>\d+)\.gbuf_idx_(?P<b>\d+)"
    r"\.dtype_(?P<dtype>.+)\.bucket_idx_(?P<k>\d+)\.(?P<kind>\w+)$"
)
_PAD = 64  # param_layout.py pad_param_start

_ATTN_TE = (
    "linear_proj.weight",
    "linear_proj.bias",
    "linear_qkv.layer_norm_weight",
    "linear_qkv.layer_norm_bias",
    "linear_qkv.weight",
    "linear_qkv.bias",
)
_ATTN_LOCAL = (
    "linear_qkv.layer_norm_weight",
    "linear_qkv.layer_norm_bias",
    "linear_proj.weight",
    "linear_proj.bias",
    "linear_qkv.weight",
    "linear_qkv.bias",
)
# multi-latent attention after linear_proj (multi_latent_attention.py: MultiLatentAttention
# registers linear_proj, then MLASelfAttention its projections, then the q / kv norms)
_MLA = (
    "linear_q_proj.weight",
    "linear_q_down_proj.weight",
    "linear_q_up_proj.layer_norm_weight",
    "linear_q_up_proj.weight",
    "linear_kv_down_proj.weight",
    "linear_kv_up_proj.layer_norm_weight",
    "linear_kv_up_proj.weight",
)
_QK_NORMS = (
    "q_layernorm.weight",
    "q_layernorm.bias",
    "k_layernorm.weight",
    "k_layernorm.bias",
    "kv_layernorm.weight",
)
_MLP = (
    # MoELayer.__init__ (moe/moe_layer.py): router, experts (own optimizer), shared experts
    # (SharedExpertMLP: its gate_weight before the fc1/fc2 submodules)
    "router.weight",
    "router.bias",
    "shared_experts.gate_weight",
    "shared_experts.linear_fc1.weight",
    "shared_experts.linear_fc2.weight",
    "linear_fc1.layer_norm_weight",
    "linear_fc1.layer_norm_bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
    "linear_fc2.weight",
    "linear_fc2.bias",
)


_MLP_NORM = ("linear_fc1.layer_norm_weight", "linear_fc1.layer_norm_bias")


def layer_order(local_spec: bool) -> tuple[str, ...]:
    """Parameter suffixes of a TransformerLayer in `named_parameters()` order, under the keys
    torch_dist saves them with (see module doc): with the local spec the pre-MLP norm's key
    `mlp.linear_fc1.layer_norm_*` stands where its module `pre_mlp_layernorm` is, before the
    MLP's (and a MoE layer's router's) own parameters; with TE it is `linear_fc1`'s own, inside
    the MLP."""
    attn = _ATTN_LOCAL if local_spec else _ATTN_TE
    pre_mlp = ("pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias")
    mlp = _MLP
    if local_spec:
        pre_mlp += tuple(f"mlp.{s}" for s in _MLP_NORM)
        mlp = tuple(s for s in _MLP if s not in _MLP_NORM)
    return (
        "input_layernorm.weight",
        "input_layernorm.bias",
        *(f"self_attention.{s}" for s in attn + _MLA + _QK_NORMS),
        *pre_mlp,
        *(f"mlp.{s}" for s in mlp),
    )


def _chunk_layers(model: Mapping[str, LazyTensor], topo: Topology, p: int, v: int, where: str):
    """Global layer numbers of model chunk v on pipeline rank p (even split)."""
    n_layers = len({int(n.split(".")[2]) for n in model if n.startswith("decoder.layers.")})
    per = n_layers // (topo.pp * topo.vpp)
    if per * topo.pp * topo.vpp != n_layers:
        raise FormatError(
            f"{where}: {n_layers} layers do not split evenly over pp={topo.pp} x vpp={topo.vpp}; "
            f"uneven pipeline stages are not supported for dp_reshardable optimizer state"
        )
    start = v * (n_layers // topo.vpp) + p * per
    return list(range(start, start + per))


def chunk_params(
    model: Mapping[str, LazyTensor],
    topo: Topology,
    p: int,
    v: int,
    *,
    tied: bool,
    local_spec: bool,
    where: str,
    by_layer: dict[int, list[str]] | None = None,
) -> list[str]:
    """Global names of the params of model chunk v on pipeline rank p, `named_parameters()` order
    (`by_layer`: `_by_layer(model)`, when the caller has it)."""
    by_layer = _by_layer(model) if by_layer is None else by_layer
    n_layers = len(by_layer)
    per = n_layers // (topo.pp * topo.vpp)
    if per * topo.pp * topo.vpp != n_layers:
        raise FormatError(
            f"{where}: {n_layers} layers do not split evenly over pp={topo.pp} x vpp={topo.vpp}; "
            f"uneven pipeline stages are not supported for dp_reshardable optimizer state"
        )
    first, last = p == 0 and v == 0, p == topo.pp - 1 and v == topo.vpp - 1
    out = []
    if first:
        out += [
            n
            for n in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
            if n in model
        ]
    order = {s: i for i, s in enumerate(layer_order(local_spec))}
    start = v * (n_layers // topo.vpp) + p * per
    for g in range(start, start + per):
        pre = f"decoder.layers.{g}."
        # the routed experts are the experts' optimizer's (see `bucket_state`)
        names = [n for n in by_layer.get(g, ()) if ".mlp.experts." not in n and not is_buffer(n)]
        unknown = sorted(n for n in names if n[len(pre) :] not in order)
        if unknown:
            raise FormatError(
                f"{where}: cannot place {unknown[:3]} in the distributed optimizer's buckets (unknown layer parameter)"
            )
        out += sorted(names, key=lambda n: order[n[len(pre) :]])
    if last:
        out += [
            n
            for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
            if n in model
        ]
        if "output_layer.weight" in model or (tied and topo.pp > 1):
            out.append("output_layer.weight")
    return out


def _by_layer(model: Mapping[str, LazyTensor]) -> dict[int, list[str]]:
    """Layer number -> the model's `decoder.layers.<n>.` names (model order)."""
    out: dict[int, list[str]] = {}
    for n in model:
        if n.startswith("decoder.layers."):
            out.setdefault(int(n.split(".")[2]), []).append(n)
    return out


def place(
    numels: list[int], sizes: list[int], what: str = "buffer", *, pad: bool = True
) -> list[tuple[int, int]]:
    """(bucket, offset in bucket) of each param (given in `named_parameters()` order), walking
    them in reverse with the stored bucket sizes `sizes` (numel_unpadded each)."""
    out: list[tuple[int, int]] = [(0, 0)] * len(numels)
    k = rel = held = 0
    for i in reversed(range(len(numels))):
        if pad:
            rel = -(-rel // _PAD) * _PAD
        if (
            held and k < len(sizes) and rel >= sizes[k]
        ):  # a shared_embedding param closes the bucket
            if rel != sizes[k]:
                break
            k, rel, held = k + 1, 0, 0
        if k >= len(sizes):
            raise FormatError(
                f"{what}: the parameters need more than the {len(sizes)} buckets stored (sizes {sizes})"
            )
        out[i] = (k, rel)
        rel += numels[i]
        held += 1
        if rel > sizes[k]:
            break
        if rel == sizes[k]:
            k, rel, held = k + 1, 0, 0
    else:
        if k == len(sizes) and rel == 0:
            return out
    raise FormatError(
        f"{what}: bucket sizes {sizes} do not add up with the {len(numels)} parameters of this "
        f"chunk ({sum(numels)} elements{', 64-element aligned' if pad else ''})"
    )


def local_shape(name: str, shape: tuple[int, ...], tp_rules: RuleSet, tp: int) -> tuple[int, ...]:
    """The shape one tensor-parallel rank holds of global `name`."""
    if tp == 1:
        return tuple(shape)
    how = tp_rules.tp_merge_for(name).merge
    if how.name == "replicated":
        return tuple(shape)
    axis = how.args[0] % len(shape)
    out = list(shape)
    if out[axis] % tp:
        raise FormatError(f"'{name}' of shape {shape} does not split over tp={tp} on axis {axis}")
    out[axis] //= tp
    return tuple(out)


def _found(tensors: Mapping[str, LazyTensor]) -> dict[tuple, dict[int, dict]]:
    """(chain, g, gbuf, dtype) -> bucket index -> kind -> (key, 1-D tensor)."""
    found: dict[tuple, dict[int, dict]] = {}
    for key, t in tensors.items():
        m = BUCKET.match(key)
        if m is None:
            continue
        at = (m.group("chain") or "", int(m.group("g")), int(m.group("b")), m.group("dtype"))
        found.setdefault(at, {}).setdefault(int(m.group("k")), {})[m.group("kind")] = (key, t)
    return found


def _buffer_views(
    found, chain: str, g: int, v: int, names: list[str], shapes: list[tuple], where: str
) -> dict[str, dict[str, LazyTensor]]:
    """kind -> name -> view of params `names` (local `shapes`, `named_parameters()` order) in
    grad buffer v of domain g of optimizer `chain`."""
    label = f"{where}: {chain}dp_group_idx_{g}.gbuf_idx_{v}"
    bufs = sorted(key for key in found if key[:3] == (chain, g, v))
    if len(bufs) != 1:
        what = "missing" if not bufs else f"split by dtype {[d for *_, d in bufs]}"
        raise FormatError(f"{label} is {what}")
    buckets = found[bufs[0]]
    if sorted(buckets) != list(range(len(buckets))):
        raise FormatError(f"{label} has buckets {sorted(buckets)}")
    sizes = []
    for k in range(len(buckets)):
        lens = {t.shape for _, t in buckets[k].values()}
        if len(lens) != 1 or len(next(iter(lens))) != 1:
            keys = sorted(key for key, _ in buckets[k].values())
            raise FormatError(f"{where}: bucket tensors {keys} are not 1-D of one size")
        sizes.append(next(iter(lens))[0])
    what = f"{label} ({sorted(buckets[0].values())[0][0]} ...)"
    numels = [math.prod(s) for s in shapes]
    try:
        spots = place(numels, sizes, what)
    except FormatError:
        spots = place(numels, sizes, what, pad=False)  # before core r0.8: no padding
    out: dict[str, dict[str, LazyTensor]] = {}
    for n, shape, n_el, (k, off) in zip(names, shapes, numels, spots, strict=True):
        for kind, (_, t) in buckets[k].items():
            view = lazy.reshape(lazy.slice_axis(t, 0, off, off + n_el), shape)
            out.setdefault(kind, {})[n] = view
    return out


def bucket_state(
    tensors: Mapping[str, LazyTensor],
    model: Mapping[str, LazyTensor],
    topo: Topology,
    tp_rules: RuleSet,
    *,
    tied: bool,
    local_spec: bool,
    where: str,
    experts: ExpertLayout | None = None,
) -> dict[str, dict[str, LazyTensor]]:
    """kind ("param" = master, "exp_avg", ...) -> global name -> state, from the bucket keys in
    `tensors`; `model` are the model tensors under global per-layer names.

    With `experts` the optimizer is Megatron's ChainedOptimizer [dense, experts]
    (optimizer/__init__.py `get_megatron_optimizer`; keys prefixed `chained_0.` / `chained_1.`,
    optimizer.py `ChainedOptimizer.sharded_state_dict`): the dense one's domains are (tp, pp) as
    without experts, its buffers without the routed experts; the experts' domain index is the
    rank in the expert `tp-ep-pp` group, `tp_rank + tp * (ep_rank + ep * pp_rank)`
    (parallel_state.py `_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP`, the optimizer's
    `data_parallel_group_idx=expt_model_parallel_rank`), its buffers the ep rank's local experts
    (distributed_data_parallel.py `expert_parallel_buffers`), read under their legacy local names
    and renamed to global experts (`formats.megatron.experts.globalize`). With ep = 1 the bucket
    keys carry no chain: the experts lie in the dense buffers (`expert_buckets`)."""
    from hybridckpt.formats.megatron.experts import globalize, is_expert

    found = _found(tensors)
    chains = sorted({c for c, *_ in found})
    inline = None  # the experts' layout where they lie in the dense buffers
    if experts is None:
        if len(chains) > 1:
            raise FormatError(
                f"{where}: several chained distributed optimizers {chains} but the model has no experts"
            )
        dense = chains[0] if chains else ""
    elif experts.ep == 1 and chains == [""]:  # one optimizer, the experts in its buffers
        dense, inline, experts = "", experts, None
    else:
        dense, expert = "chained_0.", "chained_1."
        if chains != [dense, expert]:
            unchained = " (or, with expert_model_parallel_size 1, unchained)" * (experts.ep == 1)
            raise FormatError(
                f"{where}: a mixture-of-experts model's distributed optimizer is chained "
                f"[{dense!r}, {expert!r}]{unchained}, found bucket keys of {chains}"
            )
    per_kind: dict[str, dict[tuple[int, int], dict[str, LazyTensor]]] = {}
    labels: dict[tuple[int, int], str] = {}

    def add(p: int, r: int, views: dict[str, dict[str, LazyTensor]]) -> None:
        for kind, named in views.items():
            into = per_kind.setdefault(kind, {}).setdefault((p, r), {})
            into.update(named)

    by_layer = _by_layer(model)
    for p in range(topo.pp):
        for v in range(topo.vpp):  # the chunk's params and local shapes: the same on every tp rank
            names = chunk_params(
                model, topo, p, v, tied=tied, local_spec=local_spec, where=where, by_layer=by_layer
            )
            names = [n for n in names if not is_expert(n)]
            shapes = [local_shape(n, _global_shape(model, n), tp_rules, topo.tp) for n in names]
            if inline is not None:
                layers = _chunk_layers(model, topo, p, v, where)
                names, shapes = with_inline_experts(
                    model, layers, names, shapes, inline, topo.tp, where
                )
            for r in range(topo.tp):
                g = r + topo.tp * p
                labels[(p, r)] = f"{where}: {dense}dp_group_idx_{g}"
                views = _buffer_views(found, dense, g, v, names, shapes, where)
                if inline is not None:
                    label = labels[(p, r)]
                    views = {
                        kind: globalize(named, 0, inline.local, inline.hidden, label)
                        for kind, named in views.items()
                    }
                add(p, r, views)
    if experts is not None:
        for p in range(topo.pp):
            for r in range(topo.tp):
                for e in range(experts.ep):
                    g = r + topo.tp * (e + experts.ep * p)
                    for v in range(topo.vpp):
                        layers = _chunk_layers(model, topo, p, v, where)
                        local = expert_params(model, layers, e, experts, topo.tp)
                        names, shapes = [n for n, _ in local], [s for _, s in local]
                        views = _buffer_views(found, expert, g, v, names, shapes, where)
                        label = f"{where}: {expert}dp_group_idx_{g}"
                        add(
                            p,
                            r,
                            {
                                kind: globalize(named, e, experts.local, experts.hidden, label)
                                for kind, named in views.items()
                            },
                        )
    out = {}
    for kind, per_rank in per_kind.items():
        merged = merge_tp(per_rank, labels, tp_rules, topo.tp, what=f"optimizer {kind} ")
        if tied and topo.pp > 1:
            merged.pop(
                "output_layer.weight", None
            )  # the last stage's copy of the embedding's state
        out[kind] = merged
    return out


def topology_of(tensors: Mapping[str, LazyTensor], embedding) -> Topology | None:
    """(tp, pp, vpp) the bucket keys show: `tp * pp` domains (`dp_group_idx`), `vpp` grad buffers
    each, and tp the embedding's row chunks (`VocabParallelEmbedding` cuts axis 0 by TP rank;
    `embedding` is its DCP entry); None without bucket keys. dp is not recorded (1)."""
    bufs: dict[int, set[int]] = {}
    for key in tensors:
        m = BUCKET.match(key)
        if m and m.group("chain") in (None, "chained_0."):  # the dense optimizer's domains
            bufs.setdefault(int(m.group("g")), set()).add(int(m.group("b")))
    if not bufs:
        return None
    tp = len({c.offsets[0] for c in embedding.chunks}) or 1
    if len(bufs) % tp:
        raise FormatError(
            f"{embedding.fqn}: {tp} tensor-parallel row chunks, but {len(bufs)} distributed "
            f"optimizer domains (dp_group_idx) is no multiple of it"
        )
    return Topology(tp=tp, pp=len(bufs) // tp, vpp=max(len(b) for b in bufs.values()), ep=1, dp=1)


def _global_shape(model: Mapping[str, LazyTensor], name: str) -> tuple[int, ...]:
    """The global shape of param `name`; a tied head's shared copy has the embedding's."""
    if name == "output_layer.weight" and name not in model:
        name = "embedding.word_embeddings.weight"
    return tuple(model[name].shape)
