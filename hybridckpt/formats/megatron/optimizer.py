"""Megatron-LM optimizer state of one (tp, pp) rank: optimizer slots and fp32 masters per parameter.

Two sources, both decoded against the rank's parameter list (`ParamSpec`, in the model chunk's
`parameters()` order = its state-dict order without `_extra_state`):

Distributed optimizer, `distrib_optim.pt` (NVIDIA/Megatron-LM:
megatron/core/optimizer/distrib_optimizer.py `get_parameter_state_dp_zero`, and
megatron/core/distributed/param_and_grad_buffer.py `ParamAndGradBuffer.__init__`, at HEAD
megatron/core/optimizer/distrib_optimizer.py `_compute_per_buffer_param_layout`):
- One grad buffer per model chunk (`gbuf_idx`, VPP chunks in order) and per
  `(param_dtype, grad_dtype)`; a chained (dense + MoE) optimizer saves a list of such dicts,
  `[dense, experts]`: the experts' optimizer has buffers of its own holding only the routed
  experts' params (distributed_data_parallel.py `expert_parallel_buffers`), so each list entry
  is decoded against its own parameter list (`part`).
- Inside a buffer the chunk's params lie in REVERSE `parameters()` order. Since core r0.8 each
  param start is padded up to a multiple of 64 elements; buffers are cut into buckets of about
  `bucket_size` elements (only with `overlap_grad_reduce`, only on pp rank 0 and model chunk 0),
  and a tied embedding (`shared_embedding`, PP > 1) gets a bucket of its own. A bucket ends
  padded to lcm(dp, 128) (dp before r0.7).
- Current form (`buckets_coalesced: True`): per buffer `{'param', 'exp_avg', 'exp_avg_sq'}`
  fp32 [numel_unpadded] and `'numel_unpadded'`: the buckets' unpadded contents back to back (the
  64-element gaps inside a bucket stay, as zeros). `param` is the fp32 master; every other
  tensor is an optimizer slot under torch's name (Adam's two moments; SGD's `momentum_buffer`).
  Legacy form (2024, no flag): per buffer each key is a LIST of per-bucket tensors, each the
  bucket's full padded size, plus top-level `per_bucket_numel[_unpadded]`.
- Decoding recomputes the layout (with and without the 64-element padding, with the bucket
  size from `args` and without buckets) and keeps the one whose sizes equal the file's
  `numel_unpadded`; none fitting is a FormatError naming the file and the sizes.

Non-distributed (`model_optim_rng.pt['optimizer']`, megatron/core/optimizer/optimizer.py):
`FP32Optimizer.state_dict()` is torch's `{'state': {i: {'step', 'exp_avg', 'exp_avg_sq'}},
'param_groups': [{'params': [i...], 'wd_mult', ...}]}` (the slots read as `torch_optim` says); `Float16OptimizerWithFloat16Params`
wraps it as `{'optimizer': ..., 'grad_scaler': ..., 'fp32_from_fp16_params': [[fp32]...]}`.
Param groups are built by megatron/core/optimizer/__init__.py `_get_param_groups`: params of
all chunks in order, keyed by weight decay (no decay for `*.bias` and 1-D params), groups in
order of first appearance; torch numbers the state by walking the groups.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridckpt import lazy
from hybridckpt.errors import FormatError
from hybridckpt.lazy import LazyTensor
from hybridckpt.optim import torch_optim

MASTER = "master"  # the fp32 master weight, beside the optimizer's slots
_MASTER_KEY = "param"  # its key in a distrib_optim.pt buffer
_NOT_STATE = ("numel_unpadded",)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a model chunk: `name` (as reported), `shape` (this rank's shard), and
    whether Megatron gives it a bucket of its own (`shared_embedding`)."""

    name: str
    shape: tuple[int, ...]
    shared: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """Where each param lies in a buffer's file tensor: `offsets[i]` for param i (elements).

    `buckets`: per bucket (first param index in walk order, unpadded size); `pad64`, `bucket_size`
    say which variant produced it."""

    offsets: tuple[int, ...]
    total: int
    bucket_unpadded: tuple[int, ...]
    pad64: bool
    bucket_size: int | None


def buffer_layout(params: Sequence[ParamSpec], *, pad64: bool, bucket_size: int | None) -> Layout:
    """The coalesced layout: offsets of each param in the concatenation of unpadded buckets.

    Walks params in reverse (Megatron's backprop order). Inside a bucket, starts are padded to 64
    relative to the bucket start (buckets start at multiples of 128, so relative = absolute).
    """
    n = len(params)
    offsets = [0] * n
    unpadded: list[int] = []
    world = 0  # offset in the file tensor of the current bucket's start
    rel = 0  # position inside the current bucket
    in_bucket = 0

    def close(end: int) -> None:
        nonlocal world, rel, in_bucket
        unpadded.append(end)
        world += end
        rel = 0
        in_bucket = 0

    for i in reversed(range(n)):
        p = params[i]
        if pad64:
            rel = -(-rel // 64) * 64
        if p.shared and in_bucket:
            close(rel)
        offsets[i] = world + rel
        rel += p.numel
        in_bucket += 1
        if (bucket_size is not None and rel >= bucket_size) or p.shared:
            close(rel)
    if in_bucket:
        close(rel)
    return Layout(tuple(offsets), world, tuple(unpadded), pad64, bucket_size)


def _candidates(params, bucket_sizes: Sequence[int | None]) -> list[Layout]:
    out = []
    for pad64 in (True, False):
        for bs in dict.fromkeys(bucket_sizes):
            out.append(buffer_layout(params, pad64=pad64, bucket_size=bs))
    return out


def _dtype_entry(buf: object, where: str) -> Mapping:
    if not isinstance(buf, Mapping) or not buf:
        raise FormatError(
            f"{where}: expected {{(param_dtype, grad_dtype): state}}, found {type(buf).__name__}"
        )
    if len(buf) != 1:
        keys = ", ".join(map(repr, buf))
        raise FormatError(
            f"{where}: buffers of several dtypes ({keys}) in one model chunk are not supported"
        )
    (entry,) = buf.values()
    if not isinstance(entry, Mapping):
        raise FormatError(
            f"{where}: expected a dict of param/exp_avg/exp_avg_sq, found {type(entry).__name__}"
        )
    return entry


def _slices(
    flat: Mapping[str, LazyTensor], params, offsets, where: str
) -> list[dict[str, LazyTensor]]:
    out = []
    for p, off in zip(params, offsets, strict=True):
        views = {}
        for kind, t in flat.items():
            views[kind] = lazy.reshape(lazy.slice_axis(t, 0, off, off + p.numel), p.shape)
        out.append(views)
    return out


def _buffer_kinds(entry: Mapping, where: str) -> dict[str, str]:
    """kind ("master" or a slot name) -> its key in a buffer entry: `param` and every other
    tensor (or list of bucket tensors) the entry holds."""
    if _MASTER_KEY not in entry:
        raise FormatError(f"{where}: no {_MASTER_KEY!r} (the fp32 master weights)")
    kinds = {MASTER: _MASTER_KEY}
    for key, value in entry.items():
        if key == _MASTER_KEY or key in _NOT_STATE or not isinstance(key, str):
            continue
        if isinstance(value, LazyTensor) or (
            isinstance(value, list) and value and all(isinstance(t, LazyTensor) for t in value)
        ):
            kinds[key] = key
    return kinds


def _flat_tensor(entry: Mapping, key: str, where: str) -> LazyTensor:
    t = entry.get(key)
    if not isinstance(t, LazyTensor) or t.ndim != 1:
        raise FormatError(f"{where}: {key!r} should be a 1-D fp32 tensor, found {type(t).__name__}")
    return t


def decode_distributed(
    state: object,
    chunks: Sequence[Sequence[ParamSpec]],
    bucket_sizes: Sequence[Sequence[int | None]],
    *,
    file: str,
    part: int = 0,
) -> list[list[dict[str, LazyTensor]]]:
    """Per chunk, per param: {'master', <slot>...} fp32 views of `distrib_optim.pt` (the slots
    are the buffer's other tensors: 'exp_avg', 'exp_avg_sq' for Adam).

    `bucket_sizes[v]`: the bucket sizes to try for chunk v (None = one bucket). `part`: which
    optimizer of a ChainedOptimizer's list (0 dense, 1 the experts': optimizer/__init__.py
    `get_megatron_optimizer` chains them in that order; `ChainedOptimizer.save_parameter_state`
    saves `None` for an optimizer whose data-parallel rank 0 is another rank)."""
    if isinstance(state, list):  # ChainedOptimizer: [dense, expert]
        if len(state) <= part or state[part] is None:
            raise FormatError(
                f"{file}: the chained optimizer state has no entry {part} "
                f"({'dense' if part == 0 else 'experts'}; found {len(state)} entries)"
            )
        state = state[part]
    elif part:
        raise FormatError(
            f"{file}: expected a list of chained optimizer states [dense, experts], found one"
        )
    if not isinstance(state, Mapping):
        raise FormatError(f"{file}: expected a dict of grad buffers, found {type(state).__name__}")
    coalesced = bool(state.get("buckets_coalesced"))
    out = []
    for v, params in enumerate(chunks):
        where = f"{file}: grad buffer {v}"
        if v not in state:
            raise FormatError(
                f"{where}: missing (the file has {sorted(k for k in state if isinstance(k, int))})"
            )
        entry = _dtype_entry(state[v], where)
        if coalesced:
            flat = {
                kind: _flat_tensor(entry, key, where)
                for kind, key in _buffer_kinds(entry, where).items()
            }
            want = entry.get("numel_unpadded")
            sizes = {t.shape[0] for t in flat.values()}
            if not isinstance(want, int) or sizes != {want}:
                raise FormatError(
                    f"{where}: numel_unpadded {want!r} does not match tensor sizes {sorted(sizes)}"
                )
            layouts = _candidates(params, bucket_sizes[v])
            fit = next((lay for lay in layouts if lay.total == want), None)
            if fit is None:
                tried = ", ".join(
                    f"{lay.total} (pad64={lay.pad64}, bucket_size={lay.bucket_size})"
                    for lay in layouts
                )
                raise FormatError(
                    f"{where}: numel_unpadded is {want} but the {len(params)} parameters of model "
                    f"chunk {v} lay out to {tried}; the checkpoint does not match its model"
                )
            out.append(_slices(flat, params, fit.offsets, where))
        else:
            out.append(_decode_per_bucket(entry, params, state, v, where))
    return out


def _decode_per_bucket(entry, params, state, v, where) -> list[dict[str, LazyTensor]]:
    """Legacy per-bucket lists: each bucket tensor padded; params contiguous inside a bucket."""
    lists = {}
    for kind, key in _buffer_kinds(entry, where).items():
        lst = entry.get(key)
        if not isinstance(lst, list) or not all(
            isinstance(t, LazyTensor) and t.ndim == 1 for t in lst
        ):
            raise FormatError(f"{where}: {key!r} should be a list of 1-D bucket tensors")
        lists[kind] = lst
    sizes = [t.shape[0] for t in lists[MASTER]]
    unpadded = None
    per = state.get("per_bucket_numel_unpadded")
    if isinstance(per, list) and v < len(per) and isinstance(per[v], Mapping) and len(per[v]) == 1:
        (unpadded,) = per[v].values()
    # walk params in reverse, filling buckets: a bucket is done at its unpadded size (or when
    # the next param does not fit its padded size), and a shared embedding gets its own
    result: list[dict[str, LazyTensor] | None] = [None] * len(params)
    used = [0] * len(sizes)
    b, pos = 0, 0
    for i in reversed(range(len(params))):
        p = params[i]
        full = (
            pos >= unpadded[b]
            if unpadded is not None and b < len(unpadded)
            else b < len(sizes) and pos + p.numel > sizes[b]
        )
        if pos > 0 and (full or p.shared):
            b, pos = b + 1, 0
        if b >= len(sizes) or pos + p.numel > sizes[b]:
            raise FormatError(
                f"{where}: parameter {p.name} ({p.numel} elements) does not fit in bucket {b} "
                f"(bucket sizes {sizes})"
            )
        result[i] = {
            kind: lazy.reshape(lazy.slice_axis(lst[b], 0, pos, pos + p.numel), p.shape)
            for kind, lst in lists.items()
        }
        pos += p.numel
        used[b] = pos
        if p.shared:
            b, pos = b + 1, 0
    if unpadded is not None and list(unpadded) != used[: len(unpadded)]:
        raise FormatError(
            f"{where}: per_bucket_numel_unpadded is {list(unpadded)} but the parameters fill {used}"
        )
    return result


# -- the torch optimizer state dict ----------------------------------------------------------


def _inner(opt: object, file: str, part: int = 0) -> tuple[Mapping, list | None]:
    if isinstance(opt, list):  # ChainedOptimizer: [dense, experts]
        if len(opt) <= part:
            raise FormatError(f"{file}: 'optimizer' is a list of {len(opt)}, expected entry {part}")
        opt = opt[part]
    elif part:
        raise FormatError(
            f"{file}: expected 'optimizer' to be a list [dense, experts] (ChainedOptimizer)"
        )
    if not isinstance(opt, Mapping):
        raise FormatError(f"{file}: 'optimizer' should be a dict, found {type(opt).__name__}")
    if "param_groups" in opt:
        return opt, None
    inner = opt.get("optimizer")
    if not isinstance(inner, Mapping) or "param_groups" not in inner:
        raise FormatError(
            f"{file}: 'optimizer' has neither 'param_groups' nor 'optimizer.param_groups'"
        )
    return inner, opt.get("fp32_from_fp16_params")


def param_groups(opt: object, file: str, part: int = 0) -> list[Mapping]:
    """The torch param groups (lr, betas, eps, weight_decay, step, ...) of `optimizer`."""
    inner, _ = _inner(opt, file, part)
    groups = inner["param_groups"]
    if not isinstance(groups, list):
        raise FormatError(f"{file}: optimizer.param_groups should be a list")
    return groups


def _no_wd(p: ParamSpec) -> bool:
    return p.name.endswith(".bias") or len(p.shape) == 1


def decode_torch_state(
    opt: object, params: Sequence[ParamSpec], *, file: str, part: int = 0
) -> list[dict[str, LazyTensor]] | None:
    """Per param (all chunks, in order): {<slot>...[, 'master']} (Adam: 'exp_avg', 'exp_avg_sq');
    None when the state holds none (distributed optimizer, or no step taken yet). `part`: the
    optimizer of a ChainedOptimizer's list (0 dense, 1 experts)."""
    inner, fp32 = _inner(opt, file, part)
    state = inner.get("state")
    if not state:
        return None
    groups = param_groups(opt, file, part)
    # rebuild _get_param_groups: members of each weight-decay class, in parameters() order
    classes: dict[bool, list[int]] = {}
    for i, p in enumerate(params):
        classes.setdefault(_no_wd(p), []).append(i)
    order = list(classes)  # classes in order of first appearance = Megatron's group order
    if len(groups) != len(order):
        raise FormatError(
            f"{file}: optimizer has {len(groups)} param groups but the model's parameters form "
            f"{len(order)} weight-decay groups; custom param groups are not supported"
        )
    out: list[dict[str, LazyTensor] | None] = [None] * len(params)
    first: tuple[str, tuple] | None = None  # the first parameter's slot names: all must match
    for g, (group, cls) in enumerate(zip(groups, order, strict=True)):
        members = classes[cls]
        ids = group.get("params")
        if not isinstance(ids, list) or len(ids) != len(members):
            raise FormatError(
                f"{file}: param group {g} has {len(ids) if isinstance(ids, list) else ids!r} params "
                f"but {len(members)} parameters are {'without' if cls else 'with'} weight decay"
            )
        wd_mult = group.get("wd_mult")
        if wd_mult is not None and (wd_mult == 0.0) != cls:
            raise FormatError(
                f"{file}: param group {g} has wd_mult {wd_mult}, expected {0.0 if cls else 1.0}"
            )
        for j, (sid, i) in enumerate(zip(ids, members, strict=True)):
            p = params[i]
            st = state.get(sid)
            if not isinstance(st, Mapping):
                raise FormatError(
                    f"{file}: optimizer state has no entry {sid} (parameter {p.name})"
                )
            views, _ = torch_optim.param_state(st, f"{file}: optimizer state {sid}")
            label = f"state {sid} (parameter {p.name})"
            first = first or (label, tuple(views))
            names = torch_optim.check_same_slots(
                dict([first, (label, views)]), f"{file}: optimizer"
            )
            for kind, t in views.items():
                want = torch_optim.slot_shape(names, kind, p.shape)
                if t.shape != want:
                    raise FormatError(
                        f"{file}: optimizer state {sid} {kind} for parameter {p.name}: expected shape "
                        f"{want}, found {t.shape}"
                    )
            if fp32 is not None:
                try:
                    m = fp32[g][j]
                except (IndexError, KeyError, TypeError):
                    raise FormatError(
                        f"{file}: fp32_from_fp16_params has no entry [{g}][{j}] ({p.name})"
                    ) from None
                if not isinstance(m, LazyTensor) or m.shape != p.shape:
                    raise FormatError(
                        f"{file}: fp32_from_fp16_params[{g}][{j}] does not match parameter {p.name} {p.shape}"
                    )
                views["master"] = m
            out[i] = views
    return out
