"""Qwen2-MoE family config and its HF form and rule variables (no JAX).

Qwen2MoeForCausalLM (huggingface/transformers:src/transformers/models/qwen2_moe/
modeling_qwen2_moe.py, configuration_qwen2_moe.py) is Qwen2's attention (biases on q, k and v
when `qkv_bias`, the default; o_proj has none) with, as MLP of a sparse layer
(`Qwen2MoeSparseMoeBlock`):
- `num_experts` SwiGLU experts of width `moe_intermediate_size`, `num_experts_per_tok` chosen per
  token by a softmax router (fp32) then top-k, renormalised only with `norm_topk_prob` (false in
  the releases), the weights cast to the hidden dtype (`Qwen2MoeTopKRouter`);
- plus one shared SwiGLU expert of width `shared_expert_intermediate_size`, run on every token
  and scaled by `sigmoid(shared_expert_gate(x))` (a `[1, hidden]` Linear, no bias).
Layer i is dense (a SwiGLU of width `intermediate_size`) when `i in mlp_only_layers` or
`(i + 1) % decoder_sparse_step != 0` (`Qwen2MoeDecoderLayer.__init__`), as Qwen3-MoE's.

HF `config.json` (`from_hf` / `to_hf`): architectures `Qwen2MoeForCausalLM` (or, when absent,
`model_type` "qwen2_moe"); sizes and RoPE read by Llama's reader; absent keys take transformers'
Qwen2MoeConfig defaults (num_experts 60, num_experts_per_tok 4, moe_intermediate_size 1408,
shared_expert_intermediate_size 5632, decoder_sparse_step 1, norm_topk_prob false,
mlp_only_layers [], qkv_bias true, max_position_embeddings 32768). Refused: `num_experts: 0`
(every layer dense: a Qwen2), `use_sliding_window: true` (transformers windows only some layers
then; no release turns it on). Router training options (`output_router_logits`,
`router_aux_loss_coef`) are not kept.

The family's facts as config properties (the module reads them; a test turns each off to show it
matters): `shared_expert` (the shared SwiGLU is added) and `shared_expert_gated` (scaled by its
sigmoid gate, else added whole).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mixtral import config as mixtral
from hybridckpt.models.qwen2.config import llama_to_hf, refuse_sliding_window
from hybridckpt.models.qwen3_moe.config import Qwen3MoeConfig

ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"
HF_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
               "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "norm_topk_prob": False,
               "mlp_only_layers": None, "qkv_bias": True, "max_position_embeddings": 32768}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig(Qwen3MoeConfig):
    """Qwen2-MoE: Qwen3MoeConfig's fields (the MoE sizes and which layers are dense), plus
    `shared_expert_intermediate_size` (the shared expert's SwiGLU width) and `qkv_bias`."""

    sliding_window: int | None = None
    shared_expert_intermediate_size: int = 5632
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        mixtral.MixtralConfig.__post_init__(self)
        where = type(self).__name__
        check_positive(
            self,
            ("moe_intermediate_size", "decoder_sparse_step", "shared_expert_intermediate_size"),
        )
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        object.__setattr__(self, "qkv_bias", bool(self.qkv_bias))
        if self.sliding_window is not None:
            raise ConfigError(
                f"{where}.sliding_window: expected None (no window), found {self.sliding_window!r}"
            )
        layers = self.mlp_only_layers
        if not isinstance(layers, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers
        ):
            raise ConfigError(
                f"{where}.mlp_only_layers: expected a list of ints, found {layers!r:.80}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))
        if not self.moe_layers:
            raise ConfigError(
                f"{where}: no layer is a mixture of experts (mlp_only_layers {list(self.mlp_only_layers)}, "
                f"decoder_sparse_step {self.decoder_sparse_step}); a dense model is a Qwen2"
            )

    @property
    def family(self) -> str:
        return "qwen2_moe"

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def shared_expert(self) -> bool:
        """Every MoE layer adds the shared SwiGLU expert's output to the routed experts'."""
        return True

    @property
    def shared_expert_gated(self) -> bool:
        """The shared expert's output is scaled by `sigmoid(shared_expert_gate(x))` per token."""
        return True


def from_hf(d: Mapping[str, Any], source: str) -> Qwen2MoeConfig:
    """A Qwen2MoeConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    refuse_sliding_window(d, source)
    view = {**HF_DEFAULTS, **d}
    if not view["num_experts"]:
        raise ConfigError(
            f"{source}: num_experts is {view['num_experts']!r}: a dense model (a Qwen2); expected > 0"
        )
    cfg = llama.from_hf({k: v for k, v in view.items() if k != "attention_bias"}, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    try:
        return Qwen2MoeConfig(
            **fields,
            num_experts=view["num_experts"],
            num_experts_per_tok=view["num_experts_per_tok"],
            moe_intermediate_size=view["moe_intermediate_size"],
            shared_expert_intermediate_size=view["shared_expert_intermediate_size"],
            norm_topk_prob=view["norm_topk_prob"],
            decoder_sparse_step=view["decoder_sparse_step"],
            mlp_only_layers=tuple(view["mlp_only_layers"] or ()),
            qkv_bias=view["qkv_bias"],
        )
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Qwen2MoeConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Qwen2MoeForCausalLM (`head_dim`, no
    Qwen2MoeConfig field, written only when it is not hidden_size / num_heads)."""
    d = llama_to_hf(cfg, ARCHITECTURE, MODEL_TYPE) | {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "qkv_bias": cfg.qkv_bias,
    }
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    return d


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors under Qwen2-MoE's per-expert HF names (the shared
    expert and its gate are not fused)."""
    return mixtral.fused_expert_fixes(
        names, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj"
    )


def rule_variables(cfg: Qwen2MoeConfig) -> dict[str, Any]:
    """Mixtral's rule variables (`moe_layers`, `dense_layers`, `has_dense_layers`, ...) plus
    `qkv_bias`."""
    return mixtral.rule_variables(cfg) | {"qkv_bias": cfg.qkv_bias}
