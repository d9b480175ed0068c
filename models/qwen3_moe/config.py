"""Qwen3-MoE family config and its HF form and rule variables (no JAX).

Qwen3MoeForCausalLM (huggingface/transformers:src/transformers/models/qwen3_moe/
modeling_qwen3_moe.py, configuration_qwen3_moe.py) is Qwen3's attention (per-head q/k RMSNorm
before RoPE, `head_dim` explicit or hidden / heads) with, as MLP, a mixture of `num_experts`
SwiGLU experts of width `moe_intermediate_size`, `num_experts_per_tok` chosen per token by a
softmax router then top-k, renormalised only with `norm_topk_prob`, the weights cast to the
hidden dtype (`Qwen3MoeTopKRouter`). Layer i is dense (a SwiGLU of width `intermediate_size`)
when `i in mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
(`Qwen3MoeDecoderLayer.__init__`); released models have every layer MoE. `use_sliding_window`
windows every layer by `sliding_window` (the config then keeps it, else sets it to None).

HF `config.json` (`from_hf` / `to_hf`): architectures `Qwen3MoeForCausalLM` (or, when absent,
`model_type` "qwen3_moe"); sizes and RoPE read by Llama's reader; absent keys take transformers'
Qwen3MoeConfig defaults (num_experts 128 (`num_local_experts` as transformers 5 writes it), num_experts_per_tok 8, moe_intermediate_size 768,
decoder_sparse_step 1, norm_topk_prob false, mlp_only_layers [], sliding_window 4096).
`attention_bias: true` (no released model) and `num_experts: 0` (a dense model: use Qwen3) are
refused. Router training options (`output_router_logits`, `router_aux_loss_coef`) are not kept.

Params: `models.qwen3_moe.params` (q/k norms; `moe.*` over the MoE layers, `mlp.*` over the
dense ones, `models.moe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mixtral import config as mixtral

ARCHITECTURE = "Qwen3MoeForCausalLM"
# The Hub's config.json says `num_experts`; transformers 5 (Qwen3MoeConfig.attribute_map
# num_experts -> num_local_experts) writes `num_local_experts`: both are read.
HF_DEFAULT_EXPERTS = 128
HF_DEFAULTS = {"num_experts_per_tok": 8, "moe_intermediate_size": 768,
               "decoder_sparse_step": 1, "norm_topk_prob": False, "mlp_only_layers": None,
               "sliding_window": 4096, "max_position_embeddings": 32768}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(mixtral.MixtralConfig):
    """Qwen3-MoE: MixtralConfig's fields (intermediate_size is the dense layers' width) plus
    `moe_intermediate_size` (each expert's), `norm_topk_prob`, `decoder_sparse_step` and
    `mlp_only_layers` (which layers are dense)."""

    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, ("moe_intermediate_size", "decoder_sparse_step"))
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        layers = self.mlp_only_layers
        if not isinstance(layers, list | tuple) or not all(isinstance(i, int) for i in layers):
            raise ConfigError(f"Qwen3MoeConfig.mlp_only_layers: expected a list of ints, found {layers!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))
        if not self.moe_layers:
            raise ConfigError(
                f"Qwen3MoeConfig: no layer is a mixture of experts (mlp_only_layers "
                f"{list(self.mlp_only_layers)}, decoder_sparse_step {self.decoder_sparse_step}); "
                f"a dense model is a Qwen3"
            )

    @property
    def family(self) -> str:
        return "qwen3_moe"

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Layers whose MLP is the mixture (`Qwen3MoeDecoderLayer.__init__`'s condition)."""
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def normalize_topk(self) -> bool:
        return self.norm_topk_prob

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def weights_in_hidden_dtype(self) -> bool:
        return True


def from_hf(d: Mapping[str, Any], source: str) -> Qwen3MoeConfig:
    """A Qwen3MoeConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    view = {**HF_DEFAULTS, **d}
    if "num_experts" in d and "num_local_experts" in d and d["num_experts"] != d["num_local_experts"]:
        raise ConfigError(
            f"{source}: num_experts {d['num_experts']!r} and num_local_experts "
            f"{d['num_local_experts']!r} disagree"
        )
    view["num_experts"] = d.get("num_experts", d.get("num_local_experts", HF_DEFAULT_EXPERTS))
    if view.get("attention_bias"):
        raise ConfigError(f"{source}: attention_bias=true is not supported for {ARCHITECTURE}; expected false")
    if not view["num_experts"]:
        raise ConfigError(f"{source}: num_experts is {view['num_experts']!r}: a dense model; expected > 0")
    cfg = llama.from_hf({k: v for k, v in view.items() if k != "attention_bias"}, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return Qwen3MoeConfig(
        **fields,
        sliding_window=view["sliding_window"] if view.get("use_sliding_window") else None,
        num_experts=view["num_experts"],
        num_experts_per_tok=view["num_experts_per_tok"],
        moe_intermediate_size=view["moe_intermediate_size"],
        norm_topk_prob=view["norm_topk_prob"],
        decoder_sparse_step=view["decoder_sparse_step"],
        mlp_only_layers=tuple(view["mlp_only_layers"] or ()),
    )


def to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Qwen3MoeForCausalLM."""
    d = llama.to_hf(cfg)
    del d["mlp_bias"]
    return d | {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3_moe",
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
    }


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors under Qwen3-MoE's per-expert HF names."""
    return mixtral.fused_expert_fixes(names, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")


def rule_variables(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """Mixtral's rule variables (`moe_layers`, `dense_layers`, `has_dense_layers`, ...)."""
    return mixtral.rule_variables(cfg)
