"""One Megatron-LM run on gloo CPU ranks (started by `megatron_core.py` under torchrun).

    torchrun --nproc-per-node N _megatron_core_run.py MODE OUT -- <Megatron-LM arguments>

MODE `train`: Megatron-LM's own `initialize_megatron`, `setup_model_and_optimizer`, `train_step`
(megatron/training/training.py) for `--train-iters` steps on fixed synthetic tokens, then
`save_checkpoint` (megatron/training/checkpointing.py) once per entry of OUT, a JSON list of
`[save_dir, ckpt_format, fully_reshardable]`, all of the same trained state.

MODE `reference`: ranks with tp = pp = 1 (one rank; for an expert-parallel save, ep ranks, as
its chained [dense, experts] optimizer loads only into the same chain) load a `fully_reshardable`
torch_dist save of that state with Megatron-LM's `load_checkpoint` (megatron-core's own
resharding), and write to `OUT.rank{r}` what the tests compare with: every parameter under its
megatron-core name with its Adam `exp_avg` / `exp_avg_sq` and the fp32 master
(`_get_main_param_and_optimizer_states`, the slice the rank's distributed optimizer owns), the
optimizer step, GPTModel's logits for fixed tokens (eval forward), then one more `train_step`:
the gradients its optimizer step consumed (`main_grad`) and the params after it.

The model builder follows Megatron-LM's gpt_builders.py `gpt_builder` (core_v0.19.0) and the loss
its pretrain_gpt.py `loss_func`; tokens come from a seeded generator, not a dataset.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _megatron_core_shims as shims  # noqa: E402

shims.install()

import torch  # noqa: E402

SEED_TOKENS = 20260


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Megatron-LM gpt_builders.py `gpt_builder` (core_v0.19.0), the branches these cases take."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage,
        )  # fmt: skip
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(config.num_moe_experts, config.moe_grouped_gemm)
    else:
        spec = get_gpt_layer_local_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
            config.multi_latent_attention, config.experimental_attention_variant,
            normalization=config.normalization,
        )  # fmt: skip
    mtp_spec = None
    if args.mtp_num_layers:  # megatron/training/models/gpt.py `mtp_block_spec`: the last decoder layer's spec
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_layer_specs,
            get_gpt_mtp_block_spec,
        )

        last = get_gpt_decoder_layer_specs(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage,
        )[-1]  # fmt: skip
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te, vp_stage=vp_stage)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        mtp_block_spec=mtp_spec,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling, vp_stage=vp_stage,
        pg_collection=pg_collection,
    )  # fmt: skip


def batch(step: int, micro: int, dp_rank: int, mbs: int, seq: int, vocab: int) -> dict:
    """Fixed synthetic tokens of one micro-batch: labels are the next tokens."""
    g = torch.Generator().manual_seed(SEED_TOKENS + 1000 * step + 10 * dp_rank + micro)
    toks = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
    return {
        "tokens": toks[:, :-1].contiguous(),
        "labels": toks[:, 1:].contiguous(),
        "loss_mask": torch.ones(mbs, seq),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous(),
        "attention_mask": torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1),
    }


def loss_func(loss_mask, output_tensor, model=None):
    """pretrain_gpt.py `loss_func` (core_v0.19.0) without its NaN / spiky-loss checks."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from functools import partial

    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    return out, partial(loss_func, b["loss_mask"], model=model)


def _setup(argv: list[str]):
    """Megatron-LM's initialization, model and optimizer; with `--load`, its `load_checkpoint`
    after the optimizer states exist (see below)."""
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    sys.argv = [sys.argv[0], *argv]
    parse_and_validate_args()
    shims.model_parallel_init_without_cuda()
    initialize_megatron(allow_no_cuda=True)
    args = get_args()
    load, args.load = args.load, None
    model, optimizer, scheduler = setup_model_and_optimizer(ModelType.encoder_or_decoder, model_provider)
    if load is not None and not args.no_load_optim:
        # DistributedOptimizer.state_dict reads `step` from the inner optimizer's state, which a
        # torch.optim.AdamW (no Apex / TE here) has only after a step: Megatron's own
        # `_init_optimizer_states_with_dummy_values` (a zero-grad step, overwritten by the load)
        shims.torch_adam_load_fix()
        for opt in _optimizers(optimizer):
            opt._init_optimizer_states_with_dummy_values()
        args.load = load
    if load is not None:
        args.load = load
        args.iteration, _ = load_checkpoint(model, optimizer, scheduler)
        if not args.no_load_optim:
            shims.unshare_adam_steps(_optimizers(optimizer))
    return model, optimizer, scheduler


def _iterator(step: int):
    from megatron.core import mpu
    from megatron.training import get_args
    from megatron.training.global_vars import get_tokenizer

    args = get_args()
    dp = mpu.get_data_parallel_rank()
    n = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    vocab = get_tokenizer().vocab_size
    from megatron.core.rerun_state_machine import RerunDataIterator

    mbs = [batch(step, m, dp, args.micro_batch_size, args.seq_length, vocab) for m in range(n)]
    return RerunDataIterator(iter(mbs))


def _train_step(model, optimizer, scheduler, step: int):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.training import train_step

    out = train_step(
        forward_step, _iterator(step), model, optimizer, scheduler, get_model_config(model[0]),
        get_forward_backward_func(), iteration=step,
    )  # fmt: skip
    skipped = out[1]
    if skipped:
        raise RuntimeError(f"Megatron skipped training step {step}")


def train(argv: list[str], saves: list) -> None:
    from megatron.training import get_args
    from megatron.training.checkpointing import save_checkpoint

    model, optimizer, scheduler = _setup(argv)
    args = get_args()
    if os.environ.get("MEGATRON_FINALIZE_GRADS") == "1":
        # what Megatron-LM's `train()` installs before its loop (training.py): the grads'
        # data-parallel / sequence-parallel reductions and the routers' expert-bias update
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0])
        if config.finalize_model_grads_func is None:
            config.finalize_model_grads_func = finalize_model_grads
    for step in range(args.train_iters):
        _train_step(model, optimizer, scheduler, step)
        args.consumed_train_samples += args.global_batch_size
    for save_dir, fmt, fully in saves:
        args.save, args.ckpt_format, args.dist_ckpt_optim_fully_reshardable = save_dir, fmt, fully
        args.use_dist_ckpt = fmt != "torch"
        save_checkpoint(args.train_iters, model, optimizer, scheduler, 0)
        torch.distributed.barrier()


def _named(model) -> dict:
    """The model chunk's parameters under tp = pp = ep = 1 names: a routed expert's
    `mlp.experts.local_experts.{j}` renamed to its global index, the MoE layer's own
    `local_expert_indices[j]` (moe/moe_layer.py: `ep_rank * num_local_experts + j`)."""
    import re

    from megatron.core.utils import unwrap_model

    (m,) = unwrap_model(model)
    out = {}
    for name, p in m.named_parameters():
        e = re.match(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$", name)
        if e:
            layer = m.decoder.layers[int(e[1])]  # tp = pp = 1: the chunk's layer i is global i
            g = layer.mlp.local_expert_indices[int(e[2])]
            name = f"decoder.layers.{e[1]}.mlp.experts.local_experts.{g}.{e[3]}"
        out[name] = p
    return out


def _optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _owned(optimizer, params: dict) -> dict:
    """name -> (optimizer, [start, end) of the flattened param this data-parallel rank's
    distributed optimizer holds: `_get_model_param_range_map(p)["param"]`)."""
    out = {}
    for opt in _optimizers(optimizer):
        for name, p in params.items():
            if p in opt.model_param_group_index_map:
                r = opt._get_model_param_range_map(p)["param"]
                out[name] = (opt, r.start, r.end)
    return out


def reference(argv: list[str], out: str) -> None:
    """Rank r writes `OUT.rank{r}` (a torch.save dict): the full model params it holds (dense
    ones replicated over data / expert parallel ranks, its ep rank's experts), and, of the
    slice `[start, end)` of each flattened param its distributed optimizer owns, the fp32 main
    param, the Adam moments (`_get_main_param_and_optimizer_states`) and the next step's
    gradient (the main param's `.grad` inside torch.optim.AdamW.step); the generator joins the
    ranks (megatron_core.py `join_ranks`)."""
    from megatron.core import mpu
    from megatron.training import get_args

    model, optimizer, scheduler = _setup(argv)
    args = get_args()
    params = _named(model)
    owned = _owned(optimizer, params)
    ref: dict = {"params": {}, "slices": {}, "no_weight_decay": [], "shapes": {}}
    for name, p in params.items():
        ref["params"][name] = p.detach().clone()
        ref["shapes"][name] = tuple(p.shape)
    for name, (opt, a, b) in owned.items():
        st = opt._get_main_param_and_optimizer_states(params[name])
        piece = {k: st[k].detach().clone().view(-1) for k in ("exp_avg", "exp_avg_sq")}
        piece["master"] = st["param"].detach().clone().view(-1)
        assert all(v.numel() == b - a for v in piece.values()), name
        ref["slices"][name] = {"range": (a, b), **piece}
        gi, _ = opt.model_param_group_index_map[params[name]]
        group = opt.optimizer.param_groups[gi]
        if group.get("wd_mult", 1.0) == 0.0 or group["weight_decay"] == 0.0:
            ref["no_weight_decay"].append(name)
    steps, hypers = set(), []
    for opt in _optimizers(optimizer):
        for g in opt.optimizer.param_groups:
            steps.add(int(g["step"]) if "step" in g else -1)
            hypers.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                           if k != "params" and isinstance(v, (int, float, tuple, bool))})  # fmt: skip
        ref["optimizer_class"] = type(opt.optimizer).__module__ + "." + type(opt.optimizer).__name__
    ref["steps"] = sorted(steps)
    ref["iteration"] = args.iteration
    ref["hyper"] = hypers[0]  # group 0: the weight-decayed dense params
    ref["hypers"] = hypers
    ref["ranks"] = {"dp": mpu.get_data_parallel_rank(), "ep": mpu.get_expert_model_parallel_rank()}
    # GPTModel's own logits on fixed tokens, eval mode (every rank runs it: the MoE layer's token
    # dispatch is collective over the expert-parallel ranks)
    fixed = batch(10_000, 0, 0, 2, args.seq_length, args.vocab_size)
    for m in model:
        m.eval()
    with torch.no_grad():
        logits = model[0](fixed["tokens"], fixed["position_ids"], fixed["attention_mask"])
    for m in model:
        m.train()
    ref["tokens"] = fixed["tokens"]
    ref["logits"] = logits.detach().clone()
    # the next step: the gradients each inner torch.optim.AdamW consumes (its main params'
    # `.grad`, which the DistributedOptimizer set from the model params' main_grad), and the
    # params after it (all-gathered by Megatron into the model params)
    for opt in _optimizers(optimizer):
        inner, orig = opt.optimizer, opt.optimizer.step
        mains = {}
        for name, (o, _, _) in owned.items():
            if o is opt:
                gi, go = opt.model_param_group_index_map[params[name]]
                mains[name] = inner.param_groups[gi]["params"][go]

        def step_and_record(*a, _orig=orig, _mains=mains, **k):
            for name, mp in _mains.items():
                ref["slices"][name]["grad"] = mp.grad.detach().clone().view(-1)
            return _orig(*a, **k)

        inner.step = step_and_record
    _train_step(model, optimizer, scheduler, args.iteration)
    ref["params_after"] = {n: p.detach().clone() for n, p in params.items()}
    torch.save(ref, f"{out}.rank{torch.distributed.get_rank()}")


def forward(argv: list[str], out: str) -> None:
    """A model-only reference (the save holds no optimizer: `--no-load-optim`): rank r writes
    `OUT.rank{r}` with every parameter, the routers' `expert_bias` buffers (megatron-core names,
    tp = pp = 1) and GPTModel's eval logits on the fixed tokens."""
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args

    model, _, _ = _setup(argv)
    args = get_args()
    params = _named(model)
    (m,) = unwrap_model(model)
    buffers = {n: b for n, b in m.named_buffers() if n.endswith("router.expert_bias")}
    fixed = batch(10_000, 0, 0, 2, args.seq_length, args.vocab_size)
    for c in model:
        c.eval()
    with torch.no_grad():
        logits = model[0](fixed["tokens"], fixed["position_ids"], fixed["attention_mask"])
    ref = {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "buffers": {n: b.detach().clone() for n, b in buffers.items()},
        "tokens": fixed["tokens"],
        "logits": logits.detach().clone(),
        "iteration": args.iteration,
    }
    torch.save(ref, f"{out}.rank{torch.distributed.get_rank()}")


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    argv = sys.argv[sys.argv.index("--") + 1 :]
    if mode == "train":
        train(argv, json.loads(out))
    elif mode == "reference":
        reference(argv, out)
    elif mode == "forward":
        forward(argv, out)
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
