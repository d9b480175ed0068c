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
from hybridckpt.io.config_file import read_bytes

MAX_YAML_BYTES = 16 << 20  # bytes: the largest run_config.yaml / model.yaml read (a config, not data)
YAML_NODE_FLOOR = 200_000  # nodes a YAML config may expand to through aliases, whatever its size

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
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_grouped_gemm",
    "moe_use_legacy_grouped_gemm",
    "moe_latent_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "multi_latent_attention",
    "mtp_num_layers",
    # the gated delta net's hybrid (Qwen3-Next; TransformerConfig "linear attention" fields)
    "experimental_attention_variant",
    "linear_attention_freq",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "attention_output_gate",
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
        data = _bounded_load(yaml, raw.decode("utf-8"), path)
    except (ValueError, RecursionError, yaml.YAMLError) as e:
        raise FormatError(f"{path}: not readable YAML: {str(e).splitlines()[0]}") from None
    if section is not None:
        data = data.get(section) if isinstance(data, Mapping) else None
    if not isinstance(data, Mapping):
        where = f"'{section}' of {path}" if section else path
        raise FormatError(f"{where}: expected a mapping of model config fields")
    return data


def _bounded_load(yaml, text: str, path: str):
    """`yaml.safe_load(text)`, with the document's nodes counted first, over aliases and merge
    keys (`<<: *a`), each counted again at every reference: an alias bomb (ten aliases of a list
    of ten aliases of ...: `activation_func` made so ran 91 s to 3.4 GB) or a merge bomb (PyYAML
    copies every merged pair) is refused in one line before it is constructed. The budget,
    `YAML_NODE_FLOOR` + one node per byte, is never reached by a file without aliases (a node
    takes at least one byte)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        budget = YAML_NODE_FLOOR + len(text)
        count = _expanded_nodes(node, yaml)
        if count > budget:
            raise FormatError(
                f"{path}: YAML expands to {count} nodes through its aliases and merge keys, past "
                f"the budget of {budget} for a file of {len(text)} characters; refused"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_nodes(root, yaml) -> int:
    """Nodes a full walk of the composed YAML `root` meets, an aliased node counted at every
    reference (a node being counted, reached again through an alias: once). Iterative, each
    distinct node expanded once: linear in the document."""
    totals: dict[int, int] = {id(root): 1}
    stack = [[root, iter(_children(root, yaml)), 1]]
    while stack:
        frame = stack[-1]
        for child in frame[1]:
            known = totals.get(id(child))
            if known is not None:
                frame[2] += known
                continue
            totals[id(child)] = 1
            stack.append([child, iter(_children(child, yaml)), 1])
            break
        else:
            stack.pop()
            totals[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] += frame[2]
    return totals[id(root)]


def _children(node, yaml) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


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
