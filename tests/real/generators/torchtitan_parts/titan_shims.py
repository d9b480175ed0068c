"""What makes torchtitan 0.3.0 run on CPU ranks (gloo), each shim named in the case manifests.

torchtitan targets CUDA; on a machine without it these calls are redirected, nothing else:
"""

from __future__ import annotations

NOTES = [
    "shim: torch._utils._get_available_device_type returns 'cpu' (torchtitan.tools.utils picks "
    "'cuda' when it finds no accelerator, so its device meshes would be CUDA meshes); the ranks "
    "are gloo CPU processes",
    "shim: every layer's inner attention is torchtitan's ScaledDotProductAttention (causal; "
    "models/common/attention.py, the maskless backend its graph_trainer tests use) instead of "
    "FlexAttention: torch's flex_attention has no backward on CPU ('FlexAttention does not "
    "support backward on CPU'); each sequence is one document (positions 0..15), so the "
    "block-causal mask FlexAttention would use is the causal one",
    "parallelism.spmd_backend='partial_dtensor' (a torchtitan 0.3.0 option): the default "
    "'spmd_types' leaves params as annotated plain tensors for fully_shard to turn into DTensors, "
    "which needs a torch newer than 2.13 (2.13 raises 'When dp_mesh_dims is provided, all "
    "parameters must be DTensors on the full SPMD mesh'); the DCP files hold global shapes and "
    "chunk offsets, the same for either backend",
    "shim: after parallelize_fn, every FSDP module set_force_sum_reduction_for_comms(True) (what "
    "torchtitan's enable_fsdp_symm_mem does, less its NCCL symmetric memory): torchtitan sets gradient_divide_factor 1.0, which "
    "FSDP2 sends as ReduceOp.PREMUL_SUM(1.0), and gloo has no PREMUL_SUM ('Cannot use "
    "ReduceOp.PREMUL_SUM with Gloo'); a plain SUM then a division by 1.0 gives the same values",
    "training.mixed_precision_param='float32' (FSDP computes in fp32; the default is bfloat16) so "
    "that the fp32 references are exact; torchtitan's GroupedExperts still compute the experts in "
    "bfloat16 (models/common/moe.py casts x and the weights), as on GPU",
    "the trainer's own `Trainer.train_step` runs on a Trainer object assembled from torchtitan's "
    "components (Trainer.__init__ needs a tokenizer and a dataset on disk): model config + "
    "parallelize_fn + init_weights, OptimizersContainer, LRSchedulersContainer, "
    "ParallelAwareDataloader over fixed token sequences, CheckpointManager with the Trainer "
    "itself as `train_state`, exactly as Trainer.__init__ wires them",
    "the weights torchtitan's init_weights drew are then redrawn (seeded normal, std 0.1 for "
    "matrices, 1 + 0.3 N(0,1) for norms) so that no zero or one hides a dropped tensor",
]


def install() -> None:
    """Apply the shims; call before importing torchtitan."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
