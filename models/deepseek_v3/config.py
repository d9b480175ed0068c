"""DeepSeek V3 family config and its HF form and rule variables (no JAX).

Read from huggingface/transformers:src/transformers/models/deepseek_v3/configuration_deepseek_v3.py
(5.23) and the modeling file beside it; the released checkpoints' `config.json`
(deepseek-ai/DeepSeek-V3) adds keys transformers ignores (`topk_method`, `scoring_func`,
`moe_layer_freq`, ...): the values transformers assumes are accepted, others refused.

HF `config.json` (`from_hf` / `to_hf`): architectures `DeepseekV3ForCausalLM` (or, when absent,
`model_type` "deepseek_v3"). A key missing from the file takes transformers' default (its
`DeepseekV3Config` fields), so `q_lora_rank` absent is 1536 and `q_lora_rank: null` is the plain
`q_proj`. RoPE is read by `models.rope.read_hf_rope` (v4 `rope_scaling` or v5 `rope_parameters`;
DeepSeek's yarn with `mscale` / `mscale_all_dim`) and written back unchanged. Expert weights
are read under the Hub's per-expert names (what transformers 5.23's `save_pretrained` writes);
its fused in-memory layout, when a file holds it, is renamed to them by `hf_name_fixes`.

Layers: the first `first_k_dense_replace` layers have a dense SwiGLU MLP (`intermediate_size`),
the rest an MoE MLP (`n_routed_experts` experts of width `moe_intermediate_size`, one shared
SwiGLU of width `moe_intermediate_size * n_shared_experts`). As `models.moe` lays MoE models out:
the norms and attention of every layer are `layers` `[L, ...]`, the MLPs two groups, `mlp`
(dense layers) and `moe` (MoE layers), either absent when it has no layer.

MTP (multi-token prediction) layers: released checkpoints carry `num_nextn_predict_layers`
modules after the last layer, HF keys `model.layers.{num_hidden_layers + i}.*`: a whole MoE
decoder layer plus `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}` and an
`embed_tokens` copy (deepseek-ai/DeepSeek-V3:README_WEIGHTS.md). transformers' model has no MTP
module (its save drops them, yet writes `num_nextn_predict_layers: 1`); the forward pass here
does not use them either, but they are params (`mtp` in the tree) so import and export keep them
bit for bit. `mtp_layers` is how many the checkpoint carries: `from_hf` takes
`num_nextn_predict_layers`, and `fit_to_hf_names` lowers it to the modules whose keys are present
(a transformers save has none); `num_nextn_predict_layers` itself is written back unchanged.

Params: `models.deepseek_v3.params` (fp32, kernels `[in, out]`, each group stacked on a leading
layer axis).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.mixtral.config import fused_expert_fixes
from hybridckpt.models.rope import (
    Scaling,
    check_config_rope,
    hf_rope_keys,
    read_hf_rope,
    rope_type,
    thaw,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")

# transformers' DeepseekV3Config defaults for keys a config.json may leave out
HF_DEFAULTS: Mapping[str, Any] = {
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "num_nextn_predict_layers": 1,
}
# keys of DeepSeek's own config.json that transformers ignores: the one value it assumes
ASSUMED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
           "hidden_act": "silu"}  # fmt: skip


@dataclass(frozen=True)
class DeepseekV3Config:
    """DeepSeek V3 (and R1, V3.1: same architecture).

    q_lora_rank: None means a plain `q_proj`; else q goes through `q_a_proj` (rank q_lora_rank),
    `q_a_layernorm`, `q_b_proj`. kv always goes through `kv_a_proj_with_mqa`
    (kv_lora_rank + qk_rope_head_dim outputs), `kv_a_layernorm`, `kv_b_proj`.
    Each head's q/k is `[qk_nope_head_dim | qk_rope_head_dim]`, its v `v_head_dim`.
    Routing: sigmoid scores; `e_score_correction_bias` added for choosing only; the best
    `topk_group` of `n_group` groups (each scored by its two best experts) are kept, the top
    `num_experts_per_tok` experts among them chosen; their scores renormalised when
    `norm_topk_prob`, then times `routed_scaling_factor`.
    rope_scaling: the HF rope dict as read (`models.rope.Scaling`), None for plain RoPE.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    mtp_layers: int | None = None

    def __post_init__(self) -> None:
        where = type(self).__name__
        check_positive(self, ("vocab_size", "hidden_size", "intermediate_size",
                              "moe_intermediate_size", "num_layers", "num_heads", "kv_lora_rank",
                              "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                              "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                              "max_position_embeddings"))  # fmt: skip
        if self.q_lora_rank is not None:
            check_positive(self, ("q_lora_rank",))
        check_layer_groups(self, where, ("qk_nope_head_dim",))
        as_floats(self, ("rms_norm_eps", "rope_theta", "routed_scaling_factor"))
        for name in ("norm_topk_prob", "rope_interleave", "attention_bias", "tie_word_embeddings"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(
            self, "rope_scaling", check_config_rope(self.rope_theta, self.rope_scaling, where)
        )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{where}: RoPE needs an even qk_rope_head_dim, found "
                              f"{self.qk_rope_head_dim}")  # fmt: skip
        self._check_routing(where)
        d = thaw(self.rope_scaling) or {}
        if rope_type(d) != "default" and d.get("mscale_all_dim") and d.get("factor") is None:
            raise ConfigError(f"{where}: rope_scaling with mscale_all_dim needs a factor")

    def _check_routing(self, where: str) -> None:
        """The shapes transformers' `DeepseekV3TopkRouter.forward` can run."""
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups or experts // groups < 2:
            raise ConfigError(
                f"{where}: n_routed_experts {experts} must split into n_group {groups} groups of "
                f"at least 2 experts (each group is scored by its two best)"
            )
        if self.topk_group > groups:
            raise ConfigError(f"{where}: topk_group {self.topk_group} exceeds n_group {groups}")
        if self.num_experts_per_tok > self.topk_group * (experts // groups):
            raise ConfigError(
                f"{where}: num_experts_per_tok {self.num_experts_per_tok} exceeds the "
                f"{self.topk_group * (experts // groups)} experts of the topk_group kept groups"
            )

    @property
    def family(self) -> str:
        return "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of q and k: `qk_nope_head_dim + qk_rope_head_dim`."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        """Layers 0..num_dense_layers-1 have the dense MLP (`dense_layers` group)."""
        return min(self.first_k_dense_replace, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        """Layers num_dense_layers..num_layers-1 have the MoE MLP (`moe_layers` group)."""
        return self.num_layers - self.num_dense_layers

    @property
    def softmax_scale(self) -> float:
        """Attention scale: qk_head_dim ** -0.5, times mscale**2 with mscale = 0.1 *
        mscale_all_dim * ln(factor) + 1 (1 for factor <= 1) for any rope type but default whose
        dict has a non-zero `mscale_all_dim`: transformers' `yarn_apply_mscale`, in Python floats
        as `DeepseekV3Attention.__init__` computes it."""
        scale = self.qk_head_dim ** (-0.5)
        d = thaw(self.rope_scaling) or {}
        if rope_type(d) != "default" and d.get("mscale_all_dim"):
            factor = d["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * d["mscale_all_dim"] * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return scale


def check_layer_groups(cfg: Any, where: str, more: tuple[str, ...] = ()) -> None:
    """The layer counts of a config whose first `first_k_dense_replace` layers are dense, the rest
    MoE, and `num_nextn_predict_layers` MTP modules follow (DeepSeek V3's, GLM-4.5's): those and
    `more` ints >= 0; `mtp_layers` (the modules the checkpoint carries) defaulted to all of them
    and within 0..num_nextn_predict_layers; MTP after layers all dense is refused."""
    for name in (*more, "first_k_dense_replace", "num_nextn_predict_layers"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}.{name}: expected an int >= 0, found {value!r}")
    if cfg.mtp_layers is None:
        object.__setattr__(cfg, "mtp_layers", cfg.num_nextn_predict_layers)
    if not isinstance(cfg.mtp_layers, int) or not 0 <= cfg.mtp_layers <= cfg.num_nextn_predict_layers:
        raise ConfigError(
            f"{where}.mtp_layers: expected 0..num_nextn_predict_layers "
            f"({cfg.num_nextn_predict_layers}), found {cfg.mtp_layers!r}"
        )
    if cfg.mtp_layers and cfg.first_k_dense_replace > cfg.num_layers:
        raise ConfigError(
            f"{where}: MTP layers after dense layers (first_k_dense_replace "
            f"{cfg.first_k_dense_replace} > num_layers {cfg.num_layers}) are not supported"
        )


# ---------------------------------------------------------------------------------------- HF


def _get(d: Mapping[str, Any], key: str) -> Any:
    return d[key] if key in d else HF_DEFAULTS[key]


def from_hf(d: Mapping[str, Any], source: str) -> DeepseekV3Config:
    """A DeepseekV3Config from an HF `config.json` dict; `source` names the file in errors."""
    require(d, HF_REQUIRED, source, ARCHITECTURE)
    for key, want in ASSUMED.items():
        if d.get(key, want) != want:
            raise ConfigError(
                f"{source}: {key} {d[key]!r} is not supported; expected {want!r} (what "
                f"transformers' DeepseekV3 computes)"
            )
    if d.get("quantization_config"):
        method = d["quantization_config"].get("quant_method", "?")
        raise ConfigError(
            f"{source}: quantized weights ({method}, e.g. DeepSeek's FP8 weight_scale_inv) are "
            f"not supported; expected a bf16/fp32 checkpoint (dequantize it first)"
        )
    heads = d["num_attention_heads"]
    kv_heads = d.get("num_key_value_heads") or heads
    if kv_heads != heads:  # MLA's k and v have every head; transformers' repeat_kv would break
        raise ConfigError(
            f"{source}: num_key_value_heads {kv_heads} differs from num_attention_heads {heads}; "
            f"expected them equal (MLA)"
        )
    if d.get("v_head_dim", 0) is None:
        raise ConfigError(f"{source}: v_head_dim is null; expected a positive int")
    theta, scaling = read_hf_rope(d, source)
    try:
        return _from_hf_fields(d, theta, scaling)
    except ConfigError as e:  # the config's own checks: say which file
        raise ConfigError(f"{source}: {e}") from None


def _from_hf_fields(
    d: Mapping[str, Any], theta: float, scaling: Scaling | None
) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=_get(d, "intermediate_size"),
        moe_intermediate_size=_get(d, "moe_intermediate_size"),
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        kv_lora_rank=_get(d, "kv_lora_rank"),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim"),
        qk_rope_head_dim=_get(d, "qk_rope_head_dim"),
        v_head_dim=_get(d, "v_head_dim"),
        n_routed_experts=_get(d, "n_routed_experts"),
        num_experts_per_tok=_get(d, "num_experts_per_tok"),
        q_lora_rank=_get(d, "q_lora_rank"),
        n_shared_experts=_get(d, "n_shared_experts"),
        n_group=_get(d, "n_group"),
        topk_group=_get(d, "topk_group"),
        first_k_dense_replace=_get(d, "first_k_dense_replace"),
        norm_topk_prob=_get(d, "norm_topk_prob"),
        routed_scaling_factor=_get(d, "routed_scaling_factor"),
        rms_norm_eps=_get(d, "rms_norm_eps"),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=_get(d, "rope_interleave"),
        max_position_embeddings=_get(d, "max_position_embeddings"),
        attention_bias=_get(d, "attention_bias"),
        tie_word_embeddings=_get(d, "tie_word_embeddings"),
        num_nextn_predict_layers=_get(d, "num_nextn_predict_layers"),
    )


def to_hf(cfg: DeepseekV3Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a DeepseekV3ForCausalLM."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "n_shared_experts": cfg.n_shared_experts,
        "n_routed_experts": cfg.n_routed_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "norm_topk_prob": cfg.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        **hf_rope_keys(cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings),
        "rope_interleave": cfg.rope_interleave,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
    }


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors (`save_pretrained(save_original_format=False)`:
    `mlp.experts.gate_up_proj` [X, 2M, E], `mlp.experts.down_proj` [X, E, M]) under the Hub's
    per-expert names, each expert a lazy slice (`models.mixtral.config.fused_expert_fixes`)."""
    return fused_expert_fixes(names, "mlp.gate", "mlp.experts", "gate_proj", "up_proj", "down_proj")


def fit_to_hf_names(cfg: DeepseekV3Config, names: Collection[str]) -> DeepseekV3Config:
    """`cfg` with `mtp_layers` the number of MTP modules whose keys are among the HF `names`
    (`model.layers.{num_layers + i}.*` for i = 0, 1, ... while present)."""
    present = set()
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    for name in names:
        m = pattern.match(name)
        if m and int(m.group(1)) >= cfg.num_layers:
            present.add(int(m.group(1)) - cfg.num_layers)
    count = 0
    while count in present and count < cfg.num_nextn_predict_layers:
        count += 1
    return cfg if count == cfg.mtp_layers else replace(cfg, mtp_layers=count)


# ------------------------------------------------------------------------------------ rules


def _indices(start: int, stop: int) -> str:
    return ",".join(str(i) for i in range(start, stop))


def layer_groups(cfg: Any) -> dict[str, str]:
    """The layer lists of the groups of a config with `num_dense_layers` dense layers first, MoE
    layers after, and `mtp_layers` MTP modules (DeepSeek V3's, GLM-4.5's), as comma-separated HF
    layer indices: `decoder_layers` 0..L-1, `dense_layers`, `moe_layers`, `mtp_layers` =
    num_layers + i (a list may be empty: its rules then match nothing)."""
    return {
        "decoder_layers": _indices(0, cfg.num_layers),
        "dense_layers": _indices(0, cfg.num_dense_layers),
        "moe_layers": _indices(cfg.num_dense_layers, cfg.num_layers),
        "mtp_layers": _indices(cfg.num_layers, cfg.num_layers + cfg.mtp_layers),
    }


def rule_variables(cfg: DeepseekV3Config) -> dict[str, Any]:
    """Variables a rules text may use: `models.family.RULE_VARIABLES` (num_kv_heads is
    num_heads; head_dim is qk_head_dim; intermediate_size the dense layers' width) plus the
    layer lists of the groups, as comma-separated HF layer indices (`decoder_layers` 0..L-1,
    `dense_layers`, `moe_layers`, `mtp_layers` = num_layers + i; a list may be empty: its rules
    then match nothing), and the flags the rules test."""
    return {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_heads,
        "head_dim": cfg.qk_head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size,
        "tied": cfg.tie_word_embeddings,
        "num_experts": cfg.n_routed_experts,
        **layer_groups(cfg),
        "q_lora": cfg.q_lora_rank is not None,
        "q_a_bias": cfg.q_lora_rank is not None and cfg.attention_bias,
        "attention_bias": cfg.attention_bias,
    }
