"""Routed experts in the distributed optimizer's `dp_reshardable` buffers (see `buckets`).

Where a MoE model's routed experts lie (NVIDIA/Megatron-LM:megatron/core/optimizer/__init__.py
`get_megatron_optimizer`, tensor_parallel/layers.py `allreduce`): an expert parameter is
"expert parallel" (`allreduce = False`) when `expert_model_parallel_size > 1` or
`expert_tensor_parallel_size != tensor_model_parallel_size`; those go to an optimizer of their own
over the `expert_parallel_buffers`, chained after the dense one (`chained_0.` dense, `chained_1.`
experts). Otherwise (ep = 1, experts split like the dense layers) every expert parameter is an
ordinary one: ONE unchained optimizer, the experts in the dense buffers at their
`named_parameters()` place, which is inside the MoE layer after the router (moe/moe_layer.py
`MoELayer.__init__` registers router, experts, shared_experts in that order); megatron-core
0.19.2 writes it so (tests/real/cases/megatron_core_moe_ep1_dp_reshardable).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt.errors import FormatError
from hybridckpt.lazy import LazyTensor


@dataclass(frozen=True)
class ExpertLayout:
    """How a MoE model's routed experts lie in the experts' optimizer buffers: the module
    (`"sequential"`: SequentialMLP, per local expert fc1 then fc2; `"te_grouped"`: TE
    GroupedLinear, all fc1 `weight{j}` then all fc2; `"grouped"`: GroupedMLP's `weight1` then
    `weight2`, megatron/training/arguments.py `--moe-grouped-gemm`,
    `--moe-use-legacy-grouped-gemm`), the expert-parallel size and experts per ep rank, and the
    hidden size (GroupedMLP's views)."""

    module: str
    ep: int
    local: int
    hidden: int


def expert_params(
    model: Mapping[str, LazyTensor], layers: list[int], e: int, x: ExpertLayout, tp: int
) -> list[tuple[str, tuple[int, ...]]]:
    """(local name, local shape) of ep rank e's expert params of `layers`, `named_parameters()`
    order: the names a legacy rank file has (`formats.megatron.experts.globalize` reads them)."""
    out = []
    for g in layers:
        pre = f"decoder.layers.{g}.mlp.experts."
        first = pre + f"{e * x.local}."
        fc1 = model.get(first + "linear_fc1.weight")
        fc2 = model.get(first + "linear_fc2.weight")
        if fc1 is None or fc2 is None:
            continue  # a dense layer
        s1 = (fc1.shape[0] // tp, fc1.shape[1])  # column parallel: [2 * ffn / tp, hidden]
        s2 = (fc2.shape[0], fc2.shape[1] // tp)  # row parallel: [hidden, ffn / tp]
        if x.module == "sequential":
            for j in range(x.local):
                out += [
                    (f"{pre}local_experts.{j}.linear_fc1.weight", s1),
                    (f"{pre}local_experts.{j}.linear_fc2.weight", s2),
                ]
        elif x.module == "te_grouped":
            out += [(f"{pre}linear_fc1.weight{j}", s1) for j in range(x.local)]
            out += [(f"{pre}linear_fc2.weight{j}", s2) for j in range(x.local)]
        else:  # GroupedMLP: weight1 [hidden, n * 2ffn/tp], weight2 [n * ffn/tp, hidden]
            out += [
                (f"{pre}weight1", (x.hidden, x.local * s1[0])),
                (f"{pre}weight2", (x.local * s2[1], x.hidden)),
            ]
    return out


def with_inline_experts(
    model: Mapping[str, LazyTensor],
    layers: list[int],
    names: list[str],
    shapes: list[tuple[int, ...]],
    x: ExpertLayout,
    tp: int,
    where: str,
) -> tuple[list[str], list[tuple[int, ...]]]:
    """`names` / `shapes` (a dense buffer's params of `layers`, `named_parameters()` order,
    without the routed experts) with each MoE layer's experts (ep = 1: all of them, under their
    local names, `expert_params`) placed right after that layer's router params."""
    out_n, out_s = list(names), list(shapes)
    for g in layers:
        local = expert_params(model, [g], 0, x, tp)
        if not local:
            continue  # a dense layer
        router = f"decoder.layers.{g}.mlp.router."
        at = [i for i, n in enumerate(out_n) if n.startswith(router)]
        if not at:
            raise FormatError(
                f"{where}: layer {g} holds routed experts but no '{router}weight' to place them after"
            )
        i = at[-1] + 1
        out_n[i:i] = [n for n, _ in local]
        out_s[i:i] = [s for _, s in local]
    return out_n, out_s
