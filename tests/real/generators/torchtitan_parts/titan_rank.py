"""One gloo rank of a torchtitan case: build, train with torchtitan's own Trainer step, save with
its CheckpointManager, then take the references from its runtime (rank 0 writes them).

References (numpy arrays, HF names through torchtitan's own `StateDictAdapter.to_hf`):
- `param/<hf>`: the params at the saved step (the model state dict, which torchtitan's
  FusedQKVLinear hook saves split, through `to_hf`);
- `exp_avg/<hf>`, `exp_avg_sq/<hf>`: the AdamW moments, keyed by parameter (fused `wqkv`), split
  by the same hook (`FusedQKVLinear._split_qkv_on_save`) and taken through `to_hf`;
- `step`: AdamW's step count; `tokens`, `logits`: torchtitan's forward of the saved model;
- `grad/<hf>`: the next step's gradients as AdamW sees them (after the trainer's clipping);
- `next/<hf>`: the params after torchtitan's next optimizer step.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

SEQ = 16
STEPS = 3
LR = 1e-2
SEED = 1234


class FixedTokens(torch.utils.data.IterableDataset):
    """Fixed token sequences (this dp rank's share), as torchtitan's text datasets yield them:
    `({"input": tokens[:-1], "positions": arange}, tokens[1:])`."""

    def __init__(self, vocab: int, dp_rank: int, dp_world: int, n: int = 64):
        g = torch.Generator().manual_seed(SEED)
        self.rows = torch.randint(0, vocab, (n, SEQ + 1), generator=g)[dp_rank::dp_world]

    def __iter__(self):
        for row in self.rows:
            yield {"input": row[:-1], "positions": torch.arange(SEQ)}, row[1:]


def _full(t):
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().clone()


def _redraw(model) -> None:
    """Seeded normal values in every parameter (each rank keeps its own shard of the same full
    tensor): std 0.1 for matrices, 1 + 0.3 N(0,1) for norm weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.checkpointer.utils import canonical_fqn

    with torch.no_grad():
        for i, (_name, p) in enumerate(
            sorted(model.named_parameters(), key=lambda kv: canonical_fqn(kv[0]))
        ):
            g = torch.Generator().manual_seed(SEED + 17 * i)
            full = torch.randn(p.shape, generator=g, dtype=torch.float32)
            full = 1.0 + 0.3 * full if p.ndim == 1 else 0.1 * full
            if isinstance(p, DTensor):
                p.to_local().copy_(
                    distribute_tensor(
                        full, p.device_mesh, p.placements, src_data_rank=None
                    ).to_local()
                )
            else:
                p.copy_(full)


def _loss(model_config):
    """The loss config torchtitan's own configs pair with the model: MTPLoss with MTP layers."""
    from torchtitan.components.loss import CrossEntropyLoss

    if getattr(model_config, "mtp_layers", None):
        from torchtitan.models.deepseek_v3 import MTPLoss

        return MTPLoss.Config(global_vocab_size=model_config.vocab_size)
    return CrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size)


def build(case, out: str):
    """(trainer, model, adapter): torchtitan's components wired as `Trainer.__init__` wires them."""
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.trainer import Trainer

    world = dist.get_world_size()
    spec = case.spec
    config = Trainer.Config(
        model_spec=spec,
        loss=_loss(spec.model),
        optimizer=default_adamw(lr=LR),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=None),
        training=TrainingConfig(local_batch_size=1, seq_len=SEQ, steps=100, mixed_precision_param="float32",
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", **case.parallelism),
        checkpoint=CheckpointManager.Config(enable=True, folder="ckpt", interval=STEPS, last_save_model_only=False,
                                            keep_latest_k=0),
    )  # fmt: skip
    pd = ParallelDims.from_config(config.parallelism, world)
    pd.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    spec.model.update_from_config(config=config)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=pd, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint, dump_folder=out,
    )  # fmt: skip
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # SUM reduce-scatter: gloo has no PREMUL_SUM (titan_shims.NOTES)
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    _redraw(model)
    model.train()

    t = Trainer.__new__(Trainer)
    t.config, t.parallel_dims, t.model_config = config, pd, spec.model
    t.device = torch.device("cpu")
    t.model_parts = [model]
    t.loss_fn = config.loss.build(compile_config=config.compile)
    t.optimizers = config.optimizer.build(model_parts=t.model_parts)
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(t.optimizers, t.model_parts, pd)
    t.lr_schedulers = config.lr_scheduler.build(
        optimizers=t.optimizers, training_steps=config.training.steps
    )
    t.step, t.ntokens_seen = 0, 0
    t.gradient_accumulation_steps, t.num_pipeline_parallel_microbatches = 1, 1
    batch = pd.get_mesh("batch") if pd.dp_enabled else None
    rank, size = (batch.get_local_rank(), batch.size()) if batch is not None else (0, 1)
    t.dataloader = ParallelAwareDataloader(
        FixedTokens(spec.model.vocab_size, rank, size),
        dp_rank=rank,
        dp_world_size=size,
        batch_size=1,
    )
    adapter = spec.state_dict_adapter(spec.model, None)
    t.checkpointer = config.checkpoint.build(
        dataloader=t.dataloader, model_parts=t.model_parts, optimizers=t.optimizers,
        lr_schedulers=t.lr_schedulers, states={"train_state": t}, sd_adapter=adapter, base_folder=out,
    )  # fmt: skip
    t.train_context = dist_utils.get_spmd_context(parallel_dims=pd, spmd_typechecking=False)
    t.fwd_bwd_fn = t._forward_backward_body
    t.metrics_processor = _NoMetrics()
    return t, model, adapter


class _NoMetrics:
    """The trainer's metrics processor, logging nothing (train_step asks `should_log`)."""

    ntokens_since_last_log = 0

    def should_log(self, step: int) -> bool:
        return False


def train(t, steps: int, data) -> None:
    """`steps` steps of torchtitan's own `Trainer.train_step`, saving as `Trainer.train` does."""
    for _ in range(steps):
        t.step += 1
        t.train_step(data)
        t.checkpointer.save(t.step, last_step=False)


def _split_fused(model, by_param: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed by PARAMETER (fused wqkv) split as torchtitan's own state-dict hook splits
    the model's (`FusedQKVLinear._split_qkv_on_save`)."""
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.models.common.attention import FusedQKVLinear

    out = dict(by_param)
    for name, mod in model.named_modules():
        if isinstance(mod, FusedQKVLinear):
            FusedQKVLinear._split_qkv_on_save(mod, out, canonical_fqn(name) + ".", None)
    return out


def references(t, model, adapter, data) -> dict[str, np.ndarray]:
    """The references (module doc); every rank computes them (collectives), rank 0 keeps them."""
    from torchtitan.components.checkpointer import ModelWrapper
    from torchtitan.components.checkpointer.utils import canonical_fqn

    def hf(d):
        return {k: v.numpy() for k, v in adapter.to_hf({k: _full(v) for k, v in d.items()}).items()}

    ref: dict[str, np.ndarray] = {}
    ref |= {f"param/{k}": v for k, v in hf(ModelWrapper(model).state_dict()).items()}
    (opt,) = t.optimizers.optimizers
    named = {canonical_fqn(n): p for n, p in model.named_parameters()}
    for slot in ("exp_avg", "exp_avg_sq"):
        moments = {n: _full(opt.state[p][slot]) for n, p in named.items()}
        ref |= {f"{slot}/{k}": v for k, v in hf(_split_fused(model, moments)).items()}
    (step,) = {float(opt.state[p]["step"]) for p in named.values()}
    ref["step"] = np.array(step, np.float32)
    ref |= logits(model, t.model_config.vocab_size)
    if any(n.endswith("expert_bias_E") for n, _ in model.named_buffers()):
        ref |= {
            f"{k}_without_expert_bias": v
            for k, v in logits(model, t.model_config.vocab_size, bias=False).items()
        }

    grads: dict[str, torch.Tensor] = {}

    def capture(optimizer, args, kwargs):
        grads.update({n: _full(p.grad) for n, p in named.items()})

    hook = t.optimizers.register_step_pre_hook(capture)
    t.step += 1
    t.train_step(data)  # the next step (not saved)
    hook.remove()
    ref |= {f"grad/{k}": v for k, v in hf(_split_fused(model, grads)).items()}
    ref |= {f"next/{k}": v for k, v in hf(ModelWrapper(model).state_dict()).items()}
    return ref


def logits(model, vocab: int, bias: bool = True) -> dict[str, np.ndarray]:
    """torchtitan's forward (eval) of fixed tokens `[1, SEQ]`; `bias=False` with every MoE
    layer's load-balancing `expert_bias_E` zeroed for the call (what HF's Qwen3-MoE computes)."""
    tokens = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(SEED + 1))
    positions = torch.arange(SEQ)[None]
    saved = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias_E")}
    model.eval()
    with torch.no_grad():
        if not bias:
            for n, b in model.named_buffers():
                if n in saved:
                    b.zero_()
        out = model(tokens, positions=positions)  # causal SDPA: no masks (titan_shims)
        for n, b in model.named_buffers():
            if n in saved:
                b.copy_(saved[n])
    model.train()
    if isinstance(out, list):  # MTP: [main logits, one per MTP depth]
        out = out[0]
    return {"tokens": tokens.numpy().astype(np.int32), "logits": _full(out).float().numpy()}


def run(rank: int, world: int, port: int, case_name: str, out: str, result_path: str) -> None:
    """The rank's whole job; rank 0 saves the references to `result_path` (an .npz)."""
    import titan_shims

    titan_shims.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import titan_models

        torch.manual_seed(SEED)
        case = titan_models.CASES[case_name]()
        t, model, adapter = build(case, out)
        data = iter(t.dataloader)
        train(t, STEPS, data)
        t.checkpointer.maybe_wait_for_saving()
        ref = references(t, model, adapter, data)
        if rank == 0:
            np.savez(result_path, **ref)
        t.checkpointer.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()
