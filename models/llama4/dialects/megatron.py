"""Megatron-LM's Llama 4 (text): a GPTModel with interleaved MoE layers (`--moe-layer-freq`), a
top-1 sigmoid router whose score scales the expert INPUT (`--moe-router-score-function sigmoid
--moe-router-topk 1 --moe-apply-probs-on-input`), one shared SwiGLU
(`--moe-shared-expert-intermediate-size`, the experts' width), NoPE layers (`--no-rope-freq`),
complex-pair RoPE (`--rotary-interleaved`), optionally llama3 scaling (`--use-rope-scaling`) and
the weightless L2 q/k norm (`--qk-l2-norm`). The facts are NVIDIA-NeMo/Megatron-Bridge's Llama 4
provider (`qk_l2_norm`, `moe_apply_probs_on_input`, `rotary_interleaved`, `nope_layer_interval`,
`moe_layer_freq`); the names map by `megatron.rules`; formats/megatron/config.py reads the args.

What Megatron's GPTModel computes is read as such, and what it does not compute is off in the HF
config it gives: megatron-core 0.19.2 has no chunked local attention and no attention temperature
tuning (Megatron-Bridge adds both in its own Transformer Engine attention), so the config has
`attention_chunk_size` None and `attn_temperature_tuning` False (HF Llama 4 with those values is
the model Megatron trained). Its stock layer spec puts the L2 q/k norm on EVERY layer
(gpt_layer_specs.py: `L2Norm if qk_l2_norm`), HF Llama 4 only on RoPE layers: `--qk-l2-norm`
with NoPE layers is refused (Bridge's own spec drops it on NoPE layers, but the args cannot say
which spec trained). Megatron's interleaved RoPE (rope_utils.py `_rotate_half` with
`rotary_interleaved`: pairs (2i, 2i+1), frequency i) is HF Llama 4's complex pairs: no row
permutation (`ROTARY_INTERLEAVED`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridckpt.models.errors import FormatError
from hybridckpt.models.llama.dialects.megatron import HF_KEYS as LLAMA_HF_KEYS
from hybridckpt.models.megatron_dialect import RMSNORM_SWIGLU_ROPE, hf_keys_without, positive_int

DESCRIPTION = "Llama 4"
MATCH = {
    **RMSNORM_SWIGLU_ROPE,
    "qkv_bias": False,
    "linear_bias": False,
    "qk_layernorm": False,
    "moe": True,
    "sigmoid": True,
    "expert_bias": False,
    "shared_experts": True,
    "moe_apply_probs_on_input": True,
    "rotary_interleaved": True,  # Llama 4's complex pairs; half-split RoPE is another model
}
HF_KEYS = hf_keys_without(LLAMA_HF_KEYS, "ffn_hidden_size")  # widths: hf_extra
ROTARY_INTERLEAVED = True


def nope_layers(arg: Callable[..., Any], n: int, file: str) -> list[int]:
    """Megatron's NoPE flags per layer (1: no RoPE), from `--no-rope-freq` N (every N-th layer,
    transformer_config.py: `[0] * (N - 1) + [1]` repeated) or its list."""
    freq = arg("no_rope_freq")
    if not freq:
        return [0] * n
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1 and n % freq == 0:
        return ([0] * (freq - 1) + [1]) * (n // freq)
    if isinstance(freq, list | tuple) and len(freq) == n and set(freq) <= {0, 1}:
        return [int(v) for v in freq]
    raise FormatError(f"{file}: args.no_rope_freq={freq!r:.80}: expected an int dividing num_layers {n} "
                      f"or a list of {n} 0/1 flags")  # fmt: skip


def hf_extra(arg: Callable[..., Any], values: Mapping[str, Any], file: str) -> dict[str, Any]:
    """The Llama 4 `config.json` keys beyond Llama's (module docstring); `arg(name,
    default=None)` reads the args, `values` are the format's (`dense_layers`...)."""
    n = positive_int(values["num_layers"], "num_layers", file)
    topk = arg("moe_router_topk", 2)
    if topk != 1:
        raise FormatError(f"{file}: args.moe_router_topk={topk}: Llama 4 routes each token to 1 expert")
    width = positive_int(values["moe_ffn_hidden_size"], "moe_ffn_hidden_size", file)
    shared = arg("moe_shared_expert_intermediate_size")
    if shared != width or arg("moe_shared_expert_gate"):
        raise FormatError(
            f"{file}: args.moe_shared_expert_intermediate_size={shared} (gate "
            f"{bool(arg('moe_shared_expert_gate'))}): Llama 4's one ungated shared expert has the "
            f"experts' width {width}"
        )
    if arg("moe_router_num_groups") or float(arg("moe_router_topk_scaling_factor") or 1.0) != 1.0:
        raise FormatError(f"{file}: args set router groups or a top-k scaling factor, which Llama 4 has not")
    nope = nope_layers(arg, n, file)
    if arg("qk_l2_norm") and any(nope):
        raise FormatError(
            f"{file}: args.qk_l2_norm with NoPE layers {[i for i, f in enumerate(nope) if f]}: "
            f"Megatron-LM's layer spec normalizes q/k on every layer, HF Llama 4 only on RoPE layers"
        )
    dense = set(values["dense_layers"])
    return {
        "intermediate_size": width,
        "intermediate_size_mlp": values["ffn_hidden_size"],
        "num_local_experts": values["num_experts"],
        "num_experts_per_tok": 1,
        "moe_layers": [i for i in range(n) if i not in dense],
        "interleave_moe_layer_step": 1,
        "no_rope_layers": [1 - f for f in nope],
        "use_qk_norm": bool(arg("qk_l2_norm")),
        "attention_chunk_size": None,
        "attn_temperature_tuning": False,
    }
