"""What a Megatron-LM mixture-of-experts run's `args` say about its router and its layers: the
facts the families' megatron matchers compare (`config.architecture`) and the dense layers.

Router (NVIDIA/Megatron-LM: megatron/core/transformer/moe/moe_utils.py
`topk_routing_with_score_function`, megatron/training/arguments.py `_add_moe_args`):
- softmax scores (`--moe-router-score-function softmax`, default): top-k of the logits then a
  softmax over the k (HF: softmax, top-k, renormalised: Mixtral; Qwen3-MoE
  `norm_topk_prob=True`), or with `--moe-router-pre-softmax` softmax, top-k, no renormalisation
  (Qwen3-MoE `norm_topk_prob=False`);
- sigmoid scores (DeepSeek V3): `--moe-router-enable-expert-bias` adds the `expert_bias`
  buffer for the choice only (HF `e_score_correction_bias`), `--moe-router-num-groups` /
  `--moe-router-group-topk` limit the choice to groups ranked by the sum of their top
  `topk // group_topk` scores (`group_limited_topk`; HF always sums the top 2), the k weights
  are renormalised when k > 1 (HF `norm_topk_prob=True`) and scaled by
  `--moe-router-topk-scaling-factor` (HF `routed_scaling_factor`);
- `--moe-shared-expert-intermediate-size` S: one shared SwiGLU of width S (HF
  `n_shared_experts = S / moe_intermediate_size`);
- `--moe-layer-freq` (`dense_layers`): dense layers among the MoE ones (Qwen3-MoE
  `mlp_only_layers`, DeepSeek V3 `first_k_dense_replace`).
Multi-latent attention (`--multi-latent-attention`) and what the router's facts become in an HF
config.json are the family's (e.g. models/deepseek_v3/dialects/megatron.py `hf_extra`).
"""

from __future__ import annotations

from hybridckpt.errors import FormatError
from hybridckpt.formats.megatron.layout import arg


def dense_layers(args, file: str) -> list[int]:
    """The layers without experts of an MoE run: `--moe-layer-freq` N is an MoE layer every N
    layers from layer 0, a list says per layer (1 MoE, 0 dense) (megatron/core/models/gpt/
    gpt_layer_specs.py `get_gpt_decoder_layer_specs`)."""
    freq, n = arg(args, "moe_layer_freq", 1), arg(args, "num_layers")
    if freq is None:
        freq = 1
    if isinstance(freq, int) and freq >= 1 and isinstance(n, int):
        return [i for i in range(n) if i % freq]
    if isinstance(freq, (list, tuple)) and len(freq) == n and set(freq) <= {0, 1}:
        return [i for i, f in enumerate(freq) if f == 0]
    raise FormatError(
        f"{file}: args.moe_layer_freq={freq!r}: expected an int >= 1 or a list of {n} 0/1 flags"
    )


def routing_facts(args, file: str) -> dict[str, bool]:
    """The router's and the MoE layers' facts `Architecture.routing` matches."""
    if arg(args, "moe_latent_size"):
        raise FormatError(
            f"{file}: args.moe_latent_size={arg(args, 'moe_latent_size')} (a latent expert "
            f"projection) is not supported"
        )
    score = arg(args, "moe_router_score_function", "softmax") or "softmax"
    if score not in ("softmax", "sigmoid"):
        raise FormatError(f"{file}: args.moe_router_score_function={score!r} is not supported")
    groups = arg(args, "moe_router_num_groups") or 1
    factor = arg(args, "moe_router_topk_scaling_factor")
    return {
        "pre_softmax": bool(arg(args, "moe_router_pre_softmax", False)),
        "dense_layers": bool(dense_layers(args, file)),
        "sigmoid": score == "sigmoid",
        "expert_bias": bool(arg(args, "moe_router_enable_expert_bias", False)),
        "shared_experts": bool(arg(args, "moe_shared_expert_intermediate_size")),
        "grouped": groups > 1,
        "scaled": factor not in (None, 1, 1.0),
    }
