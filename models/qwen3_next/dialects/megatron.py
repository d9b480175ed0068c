"""Megatron-Core's Qwen3-Next, as Megatron-Bridge trains it: a GPTModel whose layers are gated delta
nets (`experimental_attention_variant: gated_delta_net`, `linear_attention_freq` N: every N-th
layer gated full attention, or a list, 1 = linear) and gated full attention
(`attention_output_gate`, `qk_layernorm`, partial RoPE `rotary_percent` = HF
`partial_rotary_factor`), zero-centred norms (`layernorm_zero_centered_gamma`, Megatron-LM's
`--apply-layernorm-1p`: stored w with the forward using 1 + w, which is how HF Qwen3-Next stores
and uses its norms too), and every layer an MoE (softmax top-k renormalised) with one shared
expert behind a sigmoid gate (`moe_shared_expert_gate`). The facts are
NVIDIA-NeMo/Megatron-Bridge:src/megatron/bridge/models/qwen/qwen3_next_bridge.py
(`provider_bridge`: `layernorm_zero_centered_gamma = True`, `attention_output_gate = True`,
`experimental_attention_variant = "gated_delta_net"`, `linear_attention_freq`, the `linear_*`
sizes, `moe_shared_expert_gate = True`, `moe_router_pre_softmax = False`,
`hetereogenous_dist_checkpoint = True`, so torch_dist keys carry the global layer number); the
names and layouts map by `megatron.rules`; formats/megatron/config.py reads the args (from
Bridge's run_config.yaml: formats/megatron_dist/config.py).

Not read: MTP layers (Bridge's `mtp.layers.0.*`, HF's `mtp.*`, which the HF family does not map
either), router groups or a top-k scaling factor (HF Qwen3-Next has neither), a shared expert
without its gate. megatron-core 0.19.2 cannot build this model on a CPU machine (the hybrid spec
asserts Transformer Engine; GatedDeltaNet needs flash-linear-attention's Triton kernels), so the
test fixture is an imitation of the layout from these sources, not a save by the tool
(tests/real/test_real_megatron_qwen3_next.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridckpt.models.errors import FormatError
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE, SOFTMAX_ROUTER, positive_int
from hybridckpt.models.qwen3_moe.dialects.megatron import HF_KEYS as QWEN3_MOE_HF_KEYS

DESCRIPTION = "Qwen3-Next"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "linear_bias": False,
    "qk_layernorm": True,
    "moe": True,
    **SOFTMAX_ROUTER,
    "shared_experts": True,
    # args attributes, compared as saved
    "experimental_attention_variant": "gated_delta_net",
    "attention_output_gate": True,
    "apply_layernorm_1p": True,
    "moe_shared_expert_gate": True,
}
HF_KEYS = dict(QWEN3_MOE_HF_KEYS)
ROTARY_PERCENT = "partial_rotary_factor"
ZERO_CENTERED_NORMS = True
LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
          "linear_num_value_heads")  # fmt: skip


def layer_types(freq: Any, n: int, file: str) -> list[str]:
    """HF `layer_types` from `linear_attention_freq` (megatron-core
    experimental_attention_variant_module_specs.py: int N is `0 if (i + 1) % N == 0 else 1`, a
    list is the pattern itself; 1 = linear attention, 0 = full attention)."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        pattern = [0 if (i + 1) % freq == 0 else 1 for i in range(n)]
    elif (
        isinstance(freq, list | tuple)
        and len(freq) == n
        and all(v in (0, 1) and not isinstance(v, float) for v in freq)
    ):
        pattern = [int(v) for v in freq]
    else:
        raise FormatError(f"{file}: args.linear_attention_freq={freq!r:.80}: expected a positive int or a list "
                          f"of {n} 0/1 flags")  # fmt: skip
    return ["linear_attention" if v else "full_attention" for v in pattern]


def hf_extra(arg: Callable[..., Any], values: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The Qwen3-Next `config.json` keys beyond Qwen3-MoE's (module docstring); `arg(name,
    default=None)` reads the args, `values` are the format's."""
    n = positive_int(values["num_layers"], "num_layers", file)
    if arg("mtp_num_layers"):
        raise FormatError(f"{file}: args.mtp_num_layers={arg('mtp_num_layers')}: Qwen3-Next's MTP layers "
                          f"(HF mtp.*) are not read")  # fmt: skip
    name = "moe_shared_expert_intermediate_size"
    shared = positive_int(arg(name), name, file)
    sizes = {k: arg(k) for k in LINEAR}
    bad = {
        k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0
    }
    if bad:
        raise FormatError(
            f"{file}: args {bad!r:.120}: the gated delta net's sizes must be positive ints"
        )
    return {
        **sizes,
        "shared_expert_intermediate_size": shared,
        "layer_types": layer_types(arg("linear_attention_freq"), n, file),
        "decoder_sparse_step": 1,
        "attention_bias": False,
    }
