"""PyTorch Distributed Checkpoint (DCP) folders: FSDP2, DTensor tensor parallel, torchtitan.

Layout (pytorch/pytorch: torch/distributed/checkpoint/{metadata,filesystem,hf_storage}.py):
- `.metadata` (or rank-local `__{rank}.metadata` from `use_collectives=False`): see
  `hybridckpt.containers.dcp_metadata`. Data in `__{rank}_{n}.distcp`: every tensor chunk is a complete
  `torch.save` zip archive of the local block (shape = chunk sizes) at bytes
  `[offset, offset + length)`; byte items (param-group values, ...) are `torch.save`d objects.
  Chunks carry GLOBAL offsets; with dp x tp they are not in rank order (a q_proj over 4 ranks
  can sit at rows 0, 32, 16, 48): the offsets are trusted, never the rank order.
- With `FileSystemWriter(serialization_format=SAFETENSORS)` a `.distcp` file is instead one
  safetensors blob keyed by fqn (offsets from its `DCP_SHARDING_INFO`); the `.metadata` byte
  ranges do not locate the data then, the safetensors header does.
- Safetensors variant (`HuggingFaceStorageWriter(save_distributed=True)`, no `.metadata`):
  `shard-{rank:05d}-model-{i:05d}-of-{n:05d}.safetensors` files, each tensor a chunk whose
  global offsets are `json.loads(__metadata__["DCP_SHARDING_INFO"])[fqn]["saved_offsets"]`;
  the global shape is the maximum of `offset + size` per dim (as torch's reader computes it).

Structure: keys are the flattened state-dict paths the saving code chose. Optimizer state is
`<opt>state.<fqn>.<slot>`: every slot the optimizer keeps under torch's own name (Adam's
`exp_avg`, `exp_avg_sq`; SGD's `momentum_buffer`; see `torch_optim`) and `.step` (0-d); the
optimizer prefix `<opt>` and the model prefix `<model>` (where `<model><fqn>` is the param) are
the pair that explains most state keys (`optim.` / `model.` for `get_state_dict`, `optimizer.` /
`` for torchtitan). Without optimizer state the model prefix comes from `planner_data` paths. Param groups
are `<opt>param_groups.N.{lr, betas, eps, weight_decay, params}`, or per fqn
`<opt>param_groups.<fqn>.lr` when the optimizer state was flattened (torch's
`flatten_optimizer_state_dict`, as torchtitan saves it).

Names after the model prefix are the model's own: HF names for HF models (`hf_rules` empty), or
torchtitan's names (`tok_embeddings`, `layers.N.attention.qkv_linear.wq`, ...) mapped by the
family's torchtitan dialect (`models/<family>/dialects/torchtitan.rules`). torchtitan 0.3
(`torchtitan`): a CheckpointManager folder of `step-N/` DCP folders, the model at the top level
beside `optimizer`, `lr_scheduler`, `train_state`, `dataloader`; q/k/v saved split while their
moments are keyed by the fused `qkv_linear.wqkv` parameter (split here like the weights);
Qwen3-MoE and DeepSeek V3 grouped experts (`[experts, ...]`, EP-sharded) taken apart per expert,
params and moments alike (`rules/torchtitan_moe_experts.rules`), into HF's per-expert names by
the family's rules.

Modules: `views` (a torch.save chunk, a tiled global tensor), `storage` (files, chunks,
safetensors blobs and shards, detection), `structure` (model and optimizer prefixes, param
groups), `torchtitan` (step folders, names, fused q/k/v, trainer state), `reader` (`open`,
`detect`).
"""

from __future__ import annotations

from hybridckpt.formats.dcp.chunk import TorchSaveChunk
from hybridckpt.formats.dcp.reader import NAME, detect, open, steps  # noqa: A004 - the format contract
from hybridckpt.formats.dcp.storage import read_hf_shards
from hybridckpt.formats.dcp.structure import Structure, find_structure
from hybridckpt.lazy import Tiled, tiled

__all__ = [
    "NAME",
    "Structure",
    "Tiled",
    "TorchSaveChunk",
    "detect",
    "find_structure",
    "open",
    "steps",
    "read_hf_shards",
    "tiled",
]
