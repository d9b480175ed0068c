"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3 and the BF16_Optimizer), read without DeepSpeed.

Layout (deepspeedai/DeepSpeed: deepspeed/runtime/engine.py `save_checkpoint`, `_get_ckpt_name`,
`_get_zero_ckpt_name`; runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py,
runtime/bf16_optimizer.py `state_dict`; utils/zero_to_fp32.py rebuilds the same way):
- `<save>/latest` holds the tag; `<save>/<tag>/` (default `global_step{N}`) holds
  `mp_rank_00_model_states.pt` (stage <= 2) or `zero_pp_rank_{dp}_mp_rank_00_model_states.pt`
  (stage 3, one per DP rank), and `[bf16_]zero_pp_rank_{dp}_mp_rank_00_optim_states.pt`.
- model states: `module` (16-bit weights; empty placeholders under stage 3), `buffer_names`,
  `param_shapes` (one ordered name -> shape dict per param group, IN FLAT ORDER),
  `frozen_param_shapes`, `frozen_param_fragments` (whole tensors for stage <= 2, the rank's
  `ceil(numel/dp)` partition for stage 3), `shared_params` {alias: source} (rank 0's file),
  `global_steps`, `dp_world_size`, `mp_world_size`, `ds_config`.
- optim states `optimizer_state_dict`:
  - stage 1/2 (`zero_stage` 1 or 2): per group, rank r holds partition r of the group's flat
    fp32 vector `single_partition_of_fp32_groups[g]`: params back to back in `param_shapes`
    order, each followed by `param_alignment_paddings[g][i]` elements (absent = 0), the tail
    padded to a multiple of 2*dp and split in dp equal partitions; the padding is stripped on
    save, so the last rank's partition is shorter by `group_paddings[g]`. The optimizer slots
    are the torch state of the flat partition, `base_optimizer_state['state'][idx][<slot>]`
    (`idx` = `param_groups[g]['params'][0]`; Adam's `exp_avg`, `exp_avg_sq`, any optimizer's own
    names, see `torch_optim`), laid out like the fp32 partition (padding kept).
  - BF16_Optimizer (no `zero_stage`): the same, but the partitions are NOT stripped: the last
    rank's `group_paddings[g]` tail elements are padding.
  - stage 3 (`zero_stage` 3): every param is split on its own: `pn = ceil(numel/dp)`, rank r
    holds elements `[r*pn, (r+1)*pn)` of the flattened param (zero-padded; the padding holds
    garbage and is never read). A rank's `fp32_flat_groups` (sub-groups) joined end to end hold
    its partitions of the params of the merged `param_shapes`, back to back. The slots are
    `optimizer_state_dict['state'][i]` of sub-group i, laid out like `fp32_flat_groups[i]`.
- `partition_count` (int or per group) must equal the number of optim files.

Tensors are the fp32 master weights (what the optimizer steps), named as the module names them
(HF names for HF models: `hf_rules` is empty); frozen params come from their fragments, aliases
from `shared_params`. Only `mp_rank_00` (no tensor/pipeline parallelism) is supported.
MoE (`deepspeed.moe.layer.MoE`, ZeRO 0-2): `layer_{L}_expert_{E}_mp_rank_00_model_states.pt`
per global expert, the expert optimizer group partitioned per EP rank over its expert-data-
parallel ranks (`experts`); `rules/deepspeed_moe.rules` gives HF's per-expert names.

Modules: `files` (tag folder, rank files, small readers), `ranks` (one DP rank's optim file),
`partitions` (flat partitions cut back into params, per stage), `experts` (MoE expert files and
expert-parallel groups), `reader` (`open`).
"""

from __future__ import annotations

from hybridckpt.formats.deepspeed.files import detect, steps, tag_dir
from hybridckpt.formats.deepspeed.reader import NAME, open  # noqa: A004 - the format contract

__all__ = ["NAME", "detect", "open", "steps", "tag_dir"]
