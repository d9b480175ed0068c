"""DeepSpeed MoE (`deepspeed.moe.layer.MoE`) checkpoints: expert files, expert-parallel ZeRO groups.

Layout (deepspeedai/DeepSpeed, 0.19.8: runtime/engine.py `save_checkpoint`,
`_save_moe_checkpoint`, `_get_expert_ckpt_name`, `_get_non_moe_state_dict`,
`_get_optimizer_ckpt_name`; deepspeed/moe/utils.py
`split_params_into_different_moe_groups_for_optimizer`; utils/groups.py
`_create_expert_and_data_parallel`):
- Expert parameters are named `<module>.deepspeed_moe.experts.deepspeed_experts.<j>.<...>`
  with the LOCAL expert id j in the model; an EP rank e of `ep_size` holds experts
  `e * num_local + j`, `num_local = num_experts // ep_size`. The router is
  `<module>.deepspeed_moe.gate.wg.weight` `[experts, hidden]`.
- `layer_{L}_expert_{E}_mp_rank_{mp:02d}_model_states.pt` (L counts the MoE layers in module
  order; before 0.5 `expert_{E}_mp_rank_..`): one global expert's weights (the module's dtype),
  keys rewritten to the GLOBAL id, written by expert-data-parallel rank 0 of every EP group.
- `mp_rank_00_model_states.pt`: the module WITHOUT expert params (router kept), `num_experts`
  (one count per MoE layer), `param_shapes` of every optimizer group as rank 0 sees it: the
  expert group's names with rank 0's LOCAL ids.
- ZeRO 1/2: `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` for every rank r. The expert params
  are their own optimizer group (torch param group `{'name': 'ep_size_<ep>', 'moe': True}`),
  flattened and partitioned over the rank's expert-DATA-parallel group only
  (`partition_count[g]` = its size, dp / ep): the group of rank r holds ITS EP rank's experts.
  Ranks are laid out E + D by default (EP rank `r % ep`, expert-data-parallel rank `r // ep`);
  with `use_data_before_expert_parallelism` in ds_config, D + E (EP rank `r // (dp / ep)`,
  expert-data-parallel rank `r % (dp / ep)`).
- Without ZeRO, `expp_rank_{e}_mp_rank_00_optim_states.pt` holds the torch optimizer state of EP
  rank e keyed by parameter index: not read (the weights still are, with a note).

Each EP rank's expert group is cut back into params exactly like a dense group
(`partitions.zero12` on that rank set), its names taken from `param_shapes` with the local ids
made global. Every expert then must have its expert file, holding the same names and shapes, and
a spot check compares one row of each rebuilt master with the file's weights (cast to the file's
dtype): a topology read wrong (experts at the wrong offset) is refused, not converted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from hybridckpt import lazy
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats.deepspeed.partitions import zero12
from hybridckpt.formats.deepspeed.ranks import Rank
from hybridckpt.lazy import LazyTensor

EXPERT_FILE_RE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
EXPP_OPTIM_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LOCAL = re.compile(
    r"^(?P<pre>.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(?P<j>\d+)(?P<post>\..*)$"
)
_TOPOLOGY = "use_data_before_expert_parallelism"


def expert_files(names: list[str], folder: str) -> dict[tuple[int, int], str]:
    """(MoE layer, global expert) -> path of every expert file (layer -1 for the old naming)."""
    out = {}
    for n in names:
        m = EXPERT_FILE_RE.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise FormatError(
                    f"{os.path.join(folder, n)}: model-parallel rank {int(m.group(3))}: DeepSpeed "
                    "MoE checkpoints with tensor parallelism are not supported"
                )
            layer = int(m.group(1)) if m.group(1) is not None else -1
            out[(layer, int(m.group(2)))] = os.path.join(folder, n)
    return out


def expert_weights(files: Mapping[tuple[int, int], str]) -> dict[str, LazyTensor]:
    """Every expert file's tensors, under their global names (lazy: headers only)."""
    out: dict[str, LazyTensor] = {}
    for path in files.values():
        d = torch_save.load(path)
        if not isinstance(d, Mapping):
            raise FormatError(
                f"{path}: expected a dict of expert tensors, found {type(d).__name__}"
            )
        for k, t in d.items():
            if not isinstance(t, LazyTensor):
                raise FormatError(f"{path}: '{k}' is {type(t).__name__}, not a tensor")
            if k in out:
                raise FormatError(f"{path}: '{k}' is also in another expert file")
            out[k] = t
    return out


def is_moe_group(group: Mapping) -> bool:
    return bool(group.get("moe"))


def _ep_ranks(dp: int, ep: int, ep_rank: int, data_first: bool) -> list[int]:
    """The global ranks of EP rank `ep_rank`'s expert-data-parallel group, in partition order."""
    edp = dp // ep
    if data_first:
        return [ep_rank * edp + i for i in range(edp)]
    return [ep_rank + i * ep for i in range(edp)]


def _one_group(r: Rank, g: int) -> Rank:
    """Rank `r` restricted to its flat group `g` (so `zero12` can cut that group alone)."""
    align = [r.align[g]] if r.align is not None else None
    slots = {k: [v[g]] for k, v in r.slots.items()}
    return replace(r, fp32=[r.fp32[g]], slots=slots, paddings=[r.paddings[g]], align=align)


def global_name(name: str, ep_rank: int, num_local: int, what: str) -> str:
    m = _LOCAL.match(name)
    if not m:
        raise FormatError(
            f"{what}: '{name}' in the expert group is not a DeepSpeed expert parameter"
        )
    j = int(m.group("j"))
    if j >= num_local:
        raise FormatError(
            f"{what}: '{name}': local expert {j}, but {num_local} experts per EP rank"
        )
    return f"{m.group('pre')}{ep_rank * num_local + j}{m.group('post')}"


def zero12_moe(
    ranks: list[Rank],
    counts: list[int],
    shapes: list[dict],
    ds_config,
    stripped: bool,
    model_file: str,
) -> tuple[dict[str, dict[str, LazyTensor]], int]:
    """name -> {"fp32": master, slot: tensor} of every trainable param, expert params under
    their global ids; and the EP size. `counts`: `partition_count` per group."""
    dp = len(ranks)
    data_first = bool(ds_config.get(_TOPOLOGY, False)) if isinstance(ds_config, Mapping) else False
    out: dict[str, dict[str, LazyTensor]] = {}
    ep_sizes = set()
    for g, group in enumerate(shapes):
        torch_group = ranks[0].groups[g] if g < len(ranks[0].groups) else {}
        align = [ranks[0].align[g]] if ranks[0].align is not None else None
        if not is_moe_group(torch_group):
            if counts[g] != dp:
                raise FormatError(
                    f"{ranks[0].path}: partition_count[{g}] is {counts[g]}, but {dp} optim files"
                )
            out.update(
                zero12([_one_group(r, g) for r in ranks], [group], align, stripped, model_file)
            )
            continue
        edp = counts[g]
        if edp < 1 or dp % edp:
            raise FormatError(
                f"{ranks[0].path}: expert group {g} is partitioned {edp} ways, which does not divide "
                f"the {dp} ranks"
            )
        ep = dp // edp
        name = torch_group.get("name")
        if isinstance(name, str) and name.startswith("ep_size_") and name != f"ep_size_{ep}":
            raise FormatError(
                f"{ranks[0].path}: expert group {g} is '{name}', but {dp} ranks partitioned "
                f"{edp} ways give ep_size {ep}"
            )
        ep_sizes.add(ep)
        local = {int(m.group("j")) for n in group if (m := _LOCAL.match(n))}
        num_local = max(local) + 1 if local else 0
        for e in range(ep):
            members = [_one_group(ranks[r], g) for r in _ep_ranks(dp, ep, e, data_first)]
            params = zero12(members, [group], align, stripped, model_file)
            for n, t in params.items():
                out[global_name(n, e, num_local, f"{model_file}: param_shapes[{g}]")] = t
    if len(ep_sizes) > 1:
        raise FormatError(f"{ranks[0].path}: expert groups of several EP sizes {sorted(ep_sizes)}")
    return out, (ep_sizes.pop() if ep_sizes else 1)


def check_against_files(
    masters: Mapping[str, LazyTensor], weights: Mapping[str, LazyTensor], num_experts, folder: str
) -> None:
    """Every expert parameter rebuilt from the optimizer has its expert file with the same name
    and shape and vice versa, the experts per MoE layer match `num_experts`, and one row of each
    master equals the file's weights cast to their dtype (a wrong EP offset is refused)."""
    built = {n for n in masters if _LOCAL.match(n)}
    missing, extra = sorted(built - set(weights)), sorted(set(weights) - built)
    if missing or extra:
        raise FormatError(
            f"{folder}: expert params from the ZeRO partitions and the expert files "
            f"(layer_*_expert_*_model_states.pt) differ: not in a file {missing[:3]}, only in a "
            f"file {extra[:3]}"
        )
    per_module: dict[str, set[int]] = {}
    for n in built:
        m = _LOCAL.match(n)
        per_module.setdefault(m.group("pre"), set()).add(int(m.group("j")))
    if isinstance(num_experts, list) and len(num_experts) == len(per_module):
        for (pre, ids), want in zip(
            sorted(per_module.items(), key=_module_order), num_experts, strict=True
        ):
            if ids != set(range(want)):
                raise FormatError(
                    f"{folder}: '{pre}*' has experts {sorted(ids)[:8]}, num_experts says {want}"
                )
    for n in sorted(built):
        w, t = weights[n], masters[n]
        if tuple(w.shape) != tuple(t.shape):
            raise FormatError(
                f"{folder}: expert file '{n}' is {tuple(w.shape)}, the optimizer {t.shape}"
            )
        row = (slice(0, 1),) + tuple(slice(0, s) for s in t.shape[1:])
        box = tuple((s.start, s.stop) for s in row)
        got = lazy.cast(t, w.dtype).read_box(box)
        want = w.read_box(box)
        if not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
            raise FormatError(
                f"{folder}: '{n}': the ZeRO partitions at this expert's offset do not hold its "
                f"expert file's weights (row 0 differs): the expert-parallel layout "
                f"({_TOPOLOGY} in ds_config) does not fit"
            )


def _module_order(item) -> tuple:
    """MoE modules in module order: by the numbers in their names."""
    return tuple(int(x) for x in re.findall(r"\d+", item[0])), item[0]


def expert_count_note(num_experts, ep: int) -> str:
    n = num_experts if isinstance(num_experts, list) else [num_experts]
    total = sum(x for x in n if isinstance(x, int))
    return (
        f"DeepSpeed MoE: {len(n)} MoE layers, {total} experts over ep_size {ep}; expert params "
        "rebuilt per EP rank from its expert-data-parallel partitions, local ids made global "
        "(ep_rank * num_local + j)"
    )
