"""The common (non-sharded) state of a torch_dist checkpoint: args, iteration, optimizer groups.

Two places (NVIDIA/Megatron-LM:megatron/core/dist_checkpointing/serialization.py
`load_common_state_dict`, which reads them in this order):
- `common.pt` (older releases; strategies/common.py `save_common`): `torch.save` of the dict.
- megatron-core 0.19: the ShardedObject `common_state` (`save`: `ShardedObject("common_state",
  state_dict, (1,), (0,))`) stored inside the `.distcp` files as the DCP byte item
  `common_state/shard_0_1` (mapping.py `ShardedObject.unique_key`), whose bytes are
  `torch.save([state_dict])` (strategies/torch.py `_mcore_to_torch_sharded_object`): element 0.

The dict is what `generate_state_dict` (megatron/training/checkpointing.py) put in that is not
sharded: `args` (an argparse.Namespace; megatron enums stubbed by the restricted unpickler),
`checkpoint_version`, `iteration`, `opt_param_scheduler`, `num_floating_point_operations_so_far`,
`content_metadata` (`_build_sharded_state_dict_metadata`: `distrib_optim_sharding_type`, ...) and
the optimizer's non-tensor part (`param_groups` for the fully reshardable formats). Other
ShardedObjects are byte items named `<key>/shard_<offsets>_<shape>`: TE `_extra_state`,
`rng_state`, the distributed optimizer's `optimizer` / `per_bucket_numel*` objects, each
`torch.save([data])`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hybridckpt.containers.dcp_metadata import DcpMetadata
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats.dcp.storage import load_item
from hybridckpt.formats.megatron_dist.layout import COMMON_FILE

COMMON_OBJECT = "common_state/shard_0_1"


@dataclass(frozen=True)
class Common:
    """The common state dict and where it was read (`where`, for messages)."""

    state: Mapping
    where: str


def sharded_object(md: DcpMetadata, unique_key: str):
    """The data of the ShardedObject stored as byte item `unique_key` (element 0 of its
    `torch.save([data])`), or None when the checkpoint has no such item."""
    entry = md.bytes_items.get(unique_key)
    if entry is None:
        return None
    obj = load_item(md, unique_key)
    if not isinstance(obj, list) or not obj:
        raise FormatError(
            f"{entry.path}: '{unique_key}' should hold a one-element list (torch.save([data])), "
            f"found {type(obj).__name__}"
        )
    return obj[0]


def read_common(folder: str, md: DcpMetadata) -> Common:
    """The common state: `common.pt` when present (older releases), else the `common_state`
    object inside the `.distcp` files."""
    path = os.path.join(folder, COMMON_FILE)
    if os.path.isfile(path):
        state, where = torch_save.load(path), path
    else:
        entry = md.bytes_items.get(COMMON_OBJECT)
        if entry is None:
            raise FormatError(
                f"{folder}: no {COMMON_FILE} and no '{COMMON_OBJECT}' item in {md.files[0]}: "
                f"the common state (args, iteration) is missing"
            )
        state, where = sharded_object(md, COMMON_OBJECT), f"{entry.path} ('{COMMON_OBJECT}')"
    if not isinstance(state, Mapping):
        raise FormatError(
            f"{where}: the common state should be a dict, found {type(state).__name__}"
        )
    return Common(state, where)


def param_groups(obj) -> list[Mapping] | None:
    """The first `param_groups` list found in an optimizer's common part (a dict, or a chained
    optimizer's {index: dict}), depth first; None when there is none."""
    if isinstance(obj, Mapping):
        groups = obj.get("param_groups")
        if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups):
            return groups
        for v in obj.values():
            found = param_groups(v)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = param_groups(v)
            if found is not None:
                return found
    return None


def sharding_type(state: Mapping) -> str | None:
    """The distributed optimizer's sharding type the common state records: `content_metadata`
    (`distrib_optim_sharding_type`), else the optimizer part's `param_state_sharding_type`."""
    meta = state.get("content_metadata")
    if isinstance(meta, Mapping) and isinstance(meta.get("distrib_optim_sharding_type"), str):
        return meta["distrib_optim_sharding_type"]
    opt = state.get("optimizer")
    stack = [opt]
    while stack:
        x = stack.pop()
        if isinstance(x, Mapping):
            if isinstance(x.get("param_state_sharding_type"), str):
                return x["param_state_sharding_type"]
            stack.extend(x.values())
    return None
