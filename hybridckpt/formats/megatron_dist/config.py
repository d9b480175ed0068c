"""The model a torch_dist checkpoint holds when its common state has no Megatron-LM `args`.

Megatron-Bridge and NeMo 2 save no argparse `args`; they serialise megatron-core's model config
as YAML instead:
- Megatron-Bridge: `iter_N/run_config.yaml` (`ConfigContainer.to_yaml`), its `model:` section
  the model provider (NVIDIA-NeMo/Megatron-Bridge:src/megatron/bridge/training/checkpointing.py
  `save_checkpoint`, `read_run_config`; Bridge checks `model.tensor_model_parallel_size` /
  `pipeline_model_parallel_size` against the checkpoint's from there).
- NeMo 2: `<ckpt>/context/model.yaml`, `{_target_: <model class>, config: {...}}` (NVIDIA/NeMo:
  nemo/lightning/io; read the same way by NVIDIA-NeMo/Export-Deploy `load_nemo_config`).
Both sections are megatron-core `TransformerConfig` fields (NVIDIA/Megatron-LM:
megatron/core/transformer/transformer_config.py) plus the GPT model's (`position_embedding_type`,
`rotary_base`, `rotary_percent`, `share_embeddings_and_output_weights`, `seq_length`,
`vocab_size`: megatron/core/models/gpt/gpt_model.py). They are turned back into the Megatron-LM
argument names `formats.megatron.config` reads, inverting megatron/training/argument_utils.py
`core_transformer_config_from_args` (same-named fields copied; `swiglu` is `gated_linear_unit`
with `activation_func` silu; `group_query_attention` is a `num_query_groups` set;
`norm_epsilon` is `layernorm_epsilon`; `untie_embeddings_and_output_weights` is not
`share_embeddings_and_output_weights`; `num_experts` is `num_moe_experts`; the other MoE and
MLA fields keep their names). The padded vocabulary is the embedding's stored rows.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.config_file import read_bytes

MAX_YAML_BYTES = 16 << 20  # bytes: the largest run_config.yaml / model.yaml read (a config, not data)

_SAME = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "seq_length",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "num_moe_experts",
    # mixture of experts and multi-latent attention (TransformerConfig, MLATransformerConfig)
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_pre_softmax",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
    "moe_grouped_gemm",
    "moe_use_legacy_grouped_gemm",
    "moe_latent_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "multi_latent_attention",
    "mtp_num_layers",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
)


def read_yaml(path: str, section: str | None) -> Mapping:
    """`section` of the YAML file `path` (the whole document when None), as plain data."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with flax and orbax
        raise ConfigError(
            f"{path}: reading it needs PyYAML (pip install pyyaml), or pass --config"
        ) from None
    raw = read_bytes(path, MAX_YAML_BYTES)
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        raise FormatError(f"{path}: not readable YAML: {str(e).splitlines()[0]}") from None
    if section is not None:
        data = data.get(section) if isinstance(data, Mapping) else None
    if not isinstance(data, Mapping):
        where = f"'{section}' of {path}" if section else path
        raise FormatError(f"{where}: expected a mapping of model config fields")
    return data


def _activation(value) -> str:
    """The name of a serialised `activation_func` (`{_target_: torch.nn.functional.silu}`, a
    dotted string, or absent: megatron-core's default F.gelu)."""
    if isinstance(value, Mapping):
        value = value.get("_target_") or value.get("target")
    return str(value or "gelu").rsplit(".", 1)[-1]


def transformer_args(cfg: Mapping, padded_vocab: int, where: str) -> argparse.Namespace:
    """Megatron-LM-style `args` for a serialised TransformerConfig/GPT model config `cfg`."""
    a = {k: cfg[k] for k in _SAME if k in cfg}
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not a.get(k)]
    if missing:
        raise ConfigError(f"{where}: the model config has no {missing}; pass --config")
    act = _activation(cfg.get("activation_func"))
    gated = bool(cfg.get("gated_linear_unit"))
    if gated and act != "silu":
        raise FormatError(
            f"{where}: gated_linear_unit with activation {act} (not SwiGLU) is not supported"
        )
    a["swiglu"] = gated
    groups = a.get("num_query_groups")
    a["group_query_attention"] = groups is not None and groups != a["num_attention_heads"]
    if cfg.get("layernorm_epsilon") is not None:
        a["norm_epsilon"] = cfg["layernorm_epsilon"]
    a["apply_layernorm_1p"] = bool(cfg.get("layernorm_zero_centered_gamma"))
    a["untie_embeddings_and_output_weights"] = not cfg.get(
        "share_embeddings_and_output_weights", True
    )
    a["max_position_embeddings"] = cfg.get("max_position_embeddings") or cfg.get("seq_length")
    a["num_experts"] = a.pop("num_moe_experts", None)
    a["padded_vocab_size"] = padded_vocab
    return argparse.Namespace(**a)


def config_source(flavour: str, folder: str, context: str | None) -> tuple[str, str | None] | None:
    """(YAML file, section) holding the model config of a checkpoint without `args`, or None."""
    if flavour == "nemo2" and context is not None:
        path = os.path.join(context, "model.yaml")
        return (path, "config") if os.path.isfile(path) else None
    path = os.path.join(folder, "run_config.yaml")
    return (path, "model") if os.path.isfile(path) else None
