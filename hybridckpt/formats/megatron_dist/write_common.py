"""The common (non-sharded) state of a Megatron-Core torch_dist checkpoint we write.

megatron-core 0.19 keeps it in the ShardedObject `common_state` (byte item
`common_state/shard_0_1`, `torch.save([state])`), read back by
`dist_checkpointing.load_common_state_dict` by torch's weights-only loader (torch-side): plain values
and an `argparse.Namespace` only. What Megatron-LM's `load_checkpoint` (megatron/training/
checkpointing.py, core_v0.19.0) takes from it, and what is written here:

- `args`: a Namespace with what the load checks or reads: `num_layers`, `hidden_size`,
  `num_attention_heads`, `add_position_embedding` (`check_checkpoint_args`), the parallel sizes
  the chunks follow (a run of other sizes reshards on load: `fully_reshardable`),
  `no_save_rng=True` (there is no RNG state to restore: the run keeps its own),
  `no_save_optim` (True without optimizer state: the run then skips loading it),
  `consumed_train_samples` (the data position; the source's, else 0) and a few informational
  sizes. A run with a `--vocab-file` (GPT2BPETokenizer and the like) also compares
  `tokenizer_type`, `max_position_embeddings` and `make_vocab_size_divisible_by`
  (`check_checkpoint_args`, getattr without a default): `tokenizer_type` is written when the
  source recorded it (a Megatron source), else such a run fails on load with AttributeError
  (docs/torch-export.md). Runs with `--tokenizer-model` (HuggingFaceTokenizer) compare none.
- `checkpoint_version` 3.0, `iteration`, `num_floating_point_operations_so_far`;
- `content_metadata`: `distrib_optim_sharding_type = "fully_reshardable"` (what the optimizer
  state is requested as on load), `chained_optim_avoid_prefix`, `singleton_local_shards` False;
- `optimizer`: `{"optimizer": {"param_groups": [...]}, "param_state_sharding_type":
  "fully_reshardable"}`: Megatron's two default groups, weight-decayed (`wd_mult` 1) and not
  (`wd_mult` 0: norms and biases), each carrying torch AdamW's keys, Megatron's own
  (`max_lr`, `min_lr`, `lr_mult`, `is_expert_parallel`, `is_decoupled_lr`, `default_config`)
  and the `step`; `DistributedOptimizer.load_state_dict` pairs them with the run's groups by
  `param_group_identifier_keys` (optimizer/optimizer.py), so `max_lr` / `min_lr` must be the
  run's `--lr` / `--min-lr`;
- `opt_param_scheduler`: the source's (a Megatron source), else a constant schedule at the
  source's peak lr (`initial_lr`, else its lr) with `min_lr` Megatron's default 0.0 (the
  groups' `max_lr` / `min_lr` are the schedule's: a run resumes with `--lr` and `--min-lr`
  equal to them, else `load_state_dict` fails with KeyError on the group's identifier tuple); `OptimizerParamScheduler.load_state_dict` asserts it equals the run's unless the
  run passes `--override-opt-param-scheduler` (its own schedule, our `num_steps`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.containers.pickle.emit import Global, Obj

CHECKPOINT_VERSION = 3.0
SHARDING = "fully_reshardable"
COMMON_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", ..., (1,), (0,)).unique_key
MEGATRON_MIN_LR = 0.0  # --min-lr's default (megatron/training/arguments.py)
TORCH_ADAMW_FLAGS = {  # torch 2.13 AdamW's group keys besides the hyperparameters (Megatron's order)
    "amsgrad": False,
    "capturable": False,
    "decoupled_weight_decay": True,
    "differentiable": False,
    "foreach": None,
    "fused": None,
    "maximize": False,
}


def param_groups(hyper: Mapping[str, Any], step: int, schedule: Mapping[str, Any]) -> list[dict]:
    """Megatron's two default AdamW groups (decayed, then not) with the source's values."""
    lr = float(hyper.get("lr", schedule.get("max_lr", 1e-3)))  # the current one (informational)
    base = {
        **TORCH_ADAMW_FLAGS,
        "betas": tuple(float(b) for b in hyper.get("betas", (0.9, 0.999))),
        "eps": float(hyper.get("eps", 1e-8)),
        "lr": lr,
        "max_lr": float(schedule.get("max_lr", lr)),
        "min_lr": float(schedule.get("min_lr", lr)),
        "lr_mult": 1.0,
        "is_expert_parallel": False,
        "is_decoupled_lr": False,
        "default_config": True,
        "step": float(step),
    }
    wd = float(hyper.get("weight_decay", 0.01))
    return [
        {**base, "weight_decay": wd, "wd_mult": 1.0},
        {**base, "weight_decay": 0.0, "wd_mult": 0.0},
    ]


def scheduler_state(
    hyper: Mapping[str, Any], source: Mapping[str, Any] | None, consumed: int
) -> dict:
    """`OptimizerParamScheduler.state_dict()`: the source's, else constant at its lr (module doc)."""
    if source:
        return dict(source)
    lr = float(hyper.get("initial_lr", hyper.get("lr", 1e-3)))  # the peak: a run's --lr
    wd = float(hyper.get("weight_decay", 0.01))
    return {
        "max_lr": lr, "lr_warmup_steps": 0, "num_steps": int(consumed), "lr_decay_style": "constant",
        "lr_decay_steps": max(int(consumed), 1), "min_lr": MEGATRON_MIN_LR, "start_wd": wd, "end_wd": wd,
        "wd_incr_steps": max(int(consumed), 1), "wd_incr_style": "constant",
    }  # fmt: skip


def model_args(hf: Mapping[str, Any], attention: Mapping[str, bool]) -> tuple[dict, list[str]]:
    """The args that describe the model, as Megatron-LM records them (its argument names), from
    the HF `config.json` dict `hf` and the architecture's attention facts (`qkv_bias`,
    `qk_layernorm`: the family's megatron dialect, formats/megatron/config.py `Architecture.match`); with the notes on what Megatron
    cannot express. Megatron's own load needs few of them; a reader of the checkpoint
    (`--use-checkpoint-args`, Megatron-Bridge, ours) rebuilds the model from them."""
    heads = int(hf["num_attention_heads"])
    groups = int(hf.get("num_key_value_heads") or heads)
    notes: list[str] = []
    out = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "group_query_attention": groups != heads,
        "num_query_groups": groups,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings"),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-5)),  # (--norm-epsilon's dest)
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": hf.get("rope_theta", 10000),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
        "add_bias_linear": False,
        "add_qkv_bias": bool(attention.get("qkv_bias", False)),
        "qk_layernorm": bool(attention.get("qk_layernorm", False)),
        "use_rope_scaling": False,
    }
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        out["use_rope_scaling"] = True
        out["rope_scaling_factor"] = float(scaling.get("factor", 8.0))
        fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(scaling.get(k, v) != v for k, v in fixed.items()):
            notes.append(f"rope_scaling {dict(scaling)}: Megatron's Llama 3 scaling fixes {fixed}; the run computes "
                         f"RoPE with those")  # fmt: skip
    elif kind not in (None, "default"):
        notes.append(f"rope_scaling {dict(scaling)}: not expressible in Megatron's args; written without")
    return out, notes


def args_namespace(
    sizes: Mapping[str, Any], *, tp: int, pp: int, optimizer: bool, consumed: int
) -> Obj:
    """The `args` Namespace (module doc); `sizes`: the model's args (`model_args`),
    padded_vocab_size, make_vocab_size_divisible_by, global_batch_size, tokenizer_type (those
    known)."""
    fields = {
        **{k: v for k, v in sizes.items() if v is not None},
        "add_position_embedding": True,  # (Megatron's default, rope or not)
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "world_size": tp * pp,
        "data_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "no_save_rng": True,
        "no_save_optim": not optimizer,
        "use_dist_ckpt": True,
        "ckpt_format": "torch_dist",
        "use_distributed_optimizer": True,
        "dist_ckpt_optim_fully_reshardable": True,
        "async_save": False,
        "consumed_train_samples": int(consumed),
        "skipped_train_samples": 0,
        "consumed_valid_samples": 0,
    }
    return Obj(Global("argparse", "Namespace"), fields)


def common_state(
    *,
    args: Obj,
    iteration: int,
    groups: list[dict] | None,
    schedule: dict | None,
    flops: int = 0,
) -> dict:
    """The common state dict (module doc); `groups` None: no optimizer state."""
    state: dict[str, Any] = {
        "args": args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": int(iteration),
    }
    if groups is not None:
        state["optimizer"] = {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": SHARDING,
        }
        state["opt_param_scheduler"] = schedule
    state["num_floating_point_operations_so_far"] = int(flops)
    state["content_metadata"] = {
        "chained_optim_avoid_prefix": True,
        "distrib_optim_fully_reshardable_mem_efficient": False,
        "distrib_optim_sharding_type": SHARDING,
        "singleton_local_shards": False,
    }
    return state
