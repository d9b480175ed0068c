"""Mixtral family config and its HF form and rule variables (no JAX).

MixtralForCausalLM is Mistral (Llama's attention, RoPE, norms; a sliding window when set) whose
every MLP is a sparse mixture of `num_local_experts` SwiGLU experts of width
`intermediate_size`, `num_experts_per_tok` of them chosen per token by a softmax router then
top-k, the chosen weights renormalised to sum 1
(huggingface/transformers:src/transformers/models/mixtral/modeling_mixtral.py
`MixtralTopKRouter`, `MixtralExperts`; configuration_mixtral.py for the keys and defaults).

HF `config.json` (`from_hf` / `to_hf`): architectures `MixtralForCausalLM` (or, when
`architectures` is absent, `model_type` "mixtral"). Sizes, RoPE (`rope_theta` + `rope_scaling`
or `rope_parameters`), `head_dim` are read by Llama's reader; transformers' MixtralConfig
defaults apply to absent keys: `rope_theta` 1e6, `sliding_window` null,
`max_position_embeddings` 131072, `num_local_experts` 8, `num_experts_per_tok` 2.
`router_jitter_noise` only acts in training (not kept); `output_router_logits` and
`router_aux_loss_coef` are training options (not kept).

Tensor names: the Hub's per-expert names, which transformers 5 `save_pretrained` writes too; a
file saved with `save_original_format=False` holds transformers' fused in-memory tensors
instead, renamed on read by `hf_name_fixes` (lazily split per expert).

`MixtralConfig` also serves Qwen3-MoE (`models.qwen3_moe.config`) through the properties the
shared module and the table's dimensions read: `moe_layers` / `dense_layers` (which layers are
MoE, which dense), `expert_intermediate_size`, `normalize_topk`, `qk_norm`,
`weights_in_hidden_dtype`.

Params: `models.mixtral.params` (Llama's attention and norms, `moe.router.kernel`
`[L, embed, experts]` and `moe.experts.{gate,up,down}.kernel` `[L, experts, ...]`, `models.moe`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from hybridckpt.models.config_checks import check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.llama import config as llama
from hybridckpt.models.mistral import config as mistral

ARCHITECTURE = "MixtralForCausalLM"
HF_DEFAULTS = {"sliding_window": None, "max_position_embeddings": 4096 * 32, "num_local_experts": 8,
               "num_experts_per_tok": 2}  # fmt: skip
HF_DEFAULT_THETA = 1000000.0  # MixtralConfig.default_theta


@dataclasses.dataclass(frozen=True)
class MixtralConfig(mistral.MistralConfig):
    """Mixtral: MistralConfig's fields (intermediate_size is each expert's SwiGLU width) plus
    `num_experts` and `num_experts_per_tok` (top-k)."""

    sliding_window: int | None = None
    num_experts: int = 8
    num_experts_per_tok: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(self, ("num_experts", "num_experts_per_tok"))
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"{type(self).__name__}: num_experts_per_tok {self.num_experts_per_tok} exceeds "
                f"num_experts {self.num_experts}"
            )

    @property
    def family(self) -> str:
        return "mixtral"

    # -- what the shared MoE module reads ------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts (Mixtral: all)."""
        return tuple(range(self.num_layers))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense SwiGLU MLP instead (`mlp.*` params)."""
        moe_set = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe_set)

    @property
    def expert_intermediate_size(self) -> int:
        """Each expert's SwiGLU width (Mixtral: intermediate_size; dense layers use that too)."""
        return self.intermediate_size

    @property
    def normalize_topk(self) -> bool:
        """The top-k routing weights are renormalised to sum 1 (Mixtral: always)."""
        return True

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def weights_in_hidden_dtype(self) -> bool:
        """Routing weights cast to the hidden dtype before weighting (Mixtral: kept fp32)."""
        return False


def from_hf(d: Mapping[str, Any], source: str) -> MixtralConfig:
    """A MixtralConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, llama.HF_REQUIRED, source, ARCHITECTURE)
    view = {**HF_DEFAULTS, **d}
    if not any(view.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")):
        view["rope_theta"] = HF_DEFAULT_THETA
    cfg = mistral.from_hf(view, source)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return MixtralConfig(
        **fields,
        num_experts=view["num_local_experts"],
        num_experts_per_tok=view["num_experts_per_tok"],
    )


def to_hf(cfg: MixtralConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a MixtralForCausalLM."""
    return mistral.to_hf(cfg) | {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
    }


def fused_expert_fixes(names: Collection[str], router: str, experts: str, gate: str, up: str, down: str) -> str:
    """Rules renaming transformers 5's fused in-memory expert tensors to the Hub's per-expert
    names, when a file holds them (`save_pretrained(save_original_format=False)` writes
    `model.layers.N.mlp.experts.gate_up_proj` [X, 2M, E] (each expert's rows `[gate | up]`),
    `mlp.experts.down_proj` [X, E, M] and the router as `mlp.gate.weight`;
    transformers/conversion_mapping.py); "" for the Hub's layout. Each expert is a lazy slice
    of the fused tensor (read once, only its rows)."""
    if not any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return ""
    pre = "model.layers.$L"
    return (
        f"{pre}.mlp.experts.gate_up_proj[$E] -> {pre}.{experts}.$E.{gate}.weight, "
        f"{pre}.{experts}.$E.{up}.weight : split(0)\n"
        f"{pre}.mlp.experts.down_proj[$E] -> {pre}.{experts}.$E.{down}.weight\n"
        f"{pre}.mlp.gate.weight -> {pre}.{router}.weight\n"
        "* -> *\n"
    )


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors under Mixtral's per-expert HF names."""
    return fused_expert_fixes(names, "block_sparse_moe.gate", "block_sparse_moe.experts", "w1", "w3", "w2")


def layer_list(layers: tuple[int, ...]) -> str:
    """A layer list as the rules' index lists read it (`[$L in {moe_layers}]`): "0,2,3"."""
    return ",".join(map(str, layers))


def rule_variables(cfg: MixtralConfig) -> dict[str, Any]:
    """Llama's rule variables plus `num_experts` and the layer lists `moe_layers` /
    `dense_layers` ("0,1,..."), with `has_dense_layers` for `when` clauses."""
    return llama.rule_variables(cfg) | {
        "num_experts": cfg.num_experts,
        "moe_layers": layer_list(cfg.moe_layers),
        "dense_layers": layer_list(cfg.dense_layers),
        "has_dense_layers": bool(cfg.dense_layers),
    }
