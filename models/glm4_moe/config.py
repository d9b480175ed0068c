"""GLM-4.5 family config (GLM-4.5, GLM-4.5-Air, GLM-4.6: `Glm4MoeForCausalLM`) and its HF form
and rule variables (no JAX).

Read from huggingface/transformers:src/transformers/models/glm4_moe/configuration_glm4_moe.py
and modeling_glm4_moe.py (5.24). The model is DeepSeek V3's mixture of experts under a GQA
attention:
- attention: q/k/v projections with biases (`attention_bias`, true in the releases; o_proj has
  none), per-head q/k RMSNorm before RoPE when `use_qk_norm` (GLM-4.5: true, GLM-4.5-Air: false),
  partial rotary: half-split RoPE over the first `int(head_dim * partial_rotary_factor)` dims of
  each head (0.5: Glm4MoeConfig's default), the rest passed through; scale head_dim ** -0.5;
- MLP: the first `first_k_dense_replace` layers a SwiGLU of `intermediate_size`; the others an
  MoE: a sigmoid router whose `e_score_correction_bias` is added for choosing only, group-limited
  top-k (`n_group` / `topk_group`), weights renormalised when `norm_topk_prob`, times
  `routed_scaling_factor` (`models.deepseek_v3.routing`, the same computation), `n_routed_experts`
  SwiGLU experts of `moe_intermediate_size` and one shared SwiGLU of `moe_intermediate_size *
  n_shared_experts` on the same input.
transformers keeps the router weight and its bias in fp32 in a bf16 model
(`_keep_in_fp32_modules_strict`) and saves them so, as the released checkpoints hold them; import
and export keep each tensor's stored dtype.

HF `config.json` (`from_hf` / `to_hf`): architectures `Glm4MoeForCausalLM` (or, when absent,
`model_type` "glm4_moe"). A key missing from the file takes transformers' default (HF_DEFAULTS).
RoPE: v4's top-level `rope_theta` / `rope_scaling` / `partial_rotary_factor` or v5's
`rope_parameters` (holding `partial_rotary_factor`); as transformers, the dict's own values win
over the top-level ones; any rope type `models.rope` implements, over the rotary dims.

MTP: the releases carry `num_nextn_predict_layers` modules after the last layer
(`model.layers.{num_hidden_layers + i}.*`: a whole MoE decoder layer plus `embed_tokens`,
`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}`, DeepSeek V3's layout); transformers
drops them on load (`_keys_to_ignore_on_load_unexpected`) and its save has none. As for DeepSeek
V3 they are params (`mtp`) kept bit for bit through import and export, unused by the forward
pass; `mtp_layers` counts those a checkpoint carries (`fit_to_hf_names`).

Params: `models.glm4_moe.params` (fp32, kernels `[in, out]`, groups stacked on a leading axis).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt.models.config_checks import as_floats, check_positive, require
from hybridckpt.models.deepseek_v3 import config as deepseek
from hybridckpt.models.errors import ConfigError
from hybridckpt.models.rope import Scaling, check_config_rope, hf_rope_keys, read_hf_rope

ARCHITECTURE = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig.__post_init__'s default

# transformers' Glm4MoeConfig defaults for keys a config.json may leave out
HF_DEFAULTS: Mapping[str, Any] = {
    "intermediate_size": 10944,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
    "num_nextn_predict_layers": 1,
}


@dataclass(frozen=True)
class Glm4MoeConfig:
    """GLM-4.5 (fields as the module docstring says; head_dim None: hidden_size // num_heads).

    rope_scaling: the HF rope dict as read without `partial_rotary_factor` (`models.rope.Scaling`),
    None for plain RoPE. `mtp_layers`: the MTP modules the checkpoint carries (None: all
    `num_nextn_predict_layers`).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    head_dim: int | None = None
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    use_qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    mtp_layers: int | None = None

    def __post_init__(self) -> None:
        where = type(self).__name__
        check_positive(self, ("vocab_size", "hidden_size", "intermediate_size",
                              "moe_intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                              "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                              "n_group", "topk_group", "max_position_embeddings"))  # fmt: skip
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ConfigError(f"{where}: hidden_size {self.hidden_size} is not divisible by "
                                  f"num_heads {self.num_heads}; give head_dim explicitly")  # fmt: skip
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        check_positive(self, ("head_dim",))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}: num_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")  # fmt: skip
        deepseek.check_layer_groups(self, where)  # the same dense / MoE / MTP layers
        as_floats(self, ("rms_norm_eps", "rope_theta", "routed_scaling_factor"))
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ConfigError(f"{where}.partial_rotary_factor: expected 0 < f <= 1, found {f!r}")
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"{where}: rotary dims int(head_dim {self.head_dim} * "
                              f"partial_rotary_factor {f}) must be even and positive")  # fmt: skip
        for name in ("norm_topk_prob", "attention_bias", "use_qk_norm", "tie_word_embeddings"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        object.__setattr__(self, "rope_scaling", check_config_rope(self.rope_theta, self.rope_scaling, where))
        deepseek.DeepseekV3Config._check_routing(self, where)  # same router, same shapes

    @property
    def family(self) -> str:
        return "glm4_moe"

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE turns: `int(head_dim * partial_rotary_factor)`."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_dense_layers(self) -> int:
        """Layers 0..num_dense_layers-1 have the dense MLP (`mlp` group)."""
        return min(self.first_k_dense_replace, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        """Layers num_dense_layers..num_layers-1 have the MoE MLP (`moe` group)."""
        return self.num_layers - self.num_dense_layers


# ---------------------------------------------------------------------------------------- HF


def hf_rope(d: Mapping[str, Any], source: str) -> tuple[float, Scaling | None, float]:
    """(rope_theta, scaling without partial_rotary_factor, partial_rotary_factor) of a config
    dict: the chosen rope dict's `partial_rotary_factor`, else the top-level one, else
    `DEFAULT_PARTIAL_ROTARY` (as `convert_rope_params_to_dict` fills it)."""
    view = dict(d)
    partial = d.get("partial_rotary_factor")
    chosen = None
    for name in ("rope_scaling", "rope_parameters"):
        raw = d.get(name)
        if isinstance(raw, Mapping) and raw:
            if chosen is None:
                chosen = raw
            view[name] = {k: v for k, v in raw.items() if k != "partial_rotary_factor"}
    if chosen is not None and chosen.get("partial_rotary_factor") is not None:
        partial = chosen["partial_rotary_factor"]
    theta, scaling = read_hf_rope(view, source)
    return theta, scaling, DEFAULT_PARTIAL_ROTARY if partial is None else partial


def _get(d: Mapping[str, Any], key: str) -> Any:
    return d[key] if d.get(key) is not None else HF_DEFAULTS[key]


def from_hf(d: Mapping[str, Any], source: str) -> Glm4MoeConfig:
    """A Glm4MoeConfig from an HF `config.json` dict; `source` names the file in errors."""
    require(d, HF_REQUIRED, source, ARCHITECTURE)
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported; expected 'silu'")
    if d.get("quantization_config"):
        method = d["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"{source}: quantized weights ({method}) are not supported; expected a "
                          f"bf16/fp32 checkpoint (dequantize it first)")  # fmt: skip
    theta, scaling, partial = hf_rope(d, source)
    try:
        return Glm4MoeConfig(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=_get(d, "intermediate_size"),
            moe_intermediate_size=_get(d, "moe_intermediate_size"),
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=_get(d, "num_key_value_heads"),
            n_routed_experts=d.get("n_routed_experts", d.get("num_local_experts", HF_DEFAULTS["n_routed_experts"])),
            num_experts_per_tok=_get(d, "num_experts_per_tok"),
            head_dim=d.get("head_dim"),
            n_shared_experts=_get(d, "n_shared_experts"),
            n_group=_get(d, "n_group"),
            topk_group=_get(d, "topk_group"),
            first_k_dense_replace=_get(d, "first_k_dense_replace"),
            norm_topk_prob=_get(d, "norm_topk_prob"),
            routed_scaling_factor=_get(d, "routed_scaling_factor"),
            rms_norm_eps=_get(d, "rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=_get(d, "max_position_embeddings"),
            attention_bias=_get(d, "attention_bias"),
            use_qk_norm=_get(d, "use_qk_norm"),
            tie_word_embeddings=_get(d, "tie_word_embeddings"),
            num_nextn_predict_layers=_get(d, "num_nextn_predict_layers"),
        )
    except ConfigError as e:  # the config's own checks: say which file
        raise ConfigError(f"{source}: {e}") from None


def to_hf(cfg: Glm4MoeConfig) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Glm4MoeForCausalLM (v5's
    `rope_parameters` with `partial_rotary_factor` in it; v4's keys beside it)."""
    rope = hf_rope_keys(cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        **rope,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "attention_bias": cfg.attention_bias,
        "use_qk_norm": cfg.use_qk_norm,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
    }


def hf_name_fixes(names: Collection[str]) -> str:
    """transformers 5's fused expert tensors (`save_pretrained(save_original_format=False)`)
    under the Hub's per-expert names (DeepSeek V3's: the same module names)."""
    return deepseek.hf_name_fixes(names)


def fit_to_hf_names(cfg: Glm4MoeConfig, names: Collection[str]) -> Glm4MoeConfig:
    """`cfg` with `mtp_layers` the MTP modules whose keys are among the HF `names`
    (`model.layers.{num_layers + i}.*`, DeepSeek V3's rule)."""
    return deepseek.fit_to_hf_names(cfg, names)


# ------------------------------------------------------------------------------------ rules


def rule_variables(cfg: Glm4MoeConfig) -> dict[str, Any]:
    """Variables a rules text may use: `models.family.RULE_VARIABLES` (intermediate_size the
    dense layers' width), the layer lists of the groups (`decoder_layers`, `dense_layers`,
    `moe_layers`, `mtp_layers` = num_layers + i: comma-separated HF indices, maybe empty) and the
    flags the rules test (`attention_bias`, `qk_norm`)."""
    return {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size,
        "tied": cfg.tie_word_embeddings,
        "num_experts": cfg.n_routed_experts,
        **deepseek.layer_groups(cfg),
        "attention_bias": cfg.attention_bias,
        "qk_norm": cfg.use_qk_norm,
    }
