"""The model a Megatron-LM checkpoint holds, from its `args`: an HF config and the rules to HF names.

Megatron records no architecture name, only the choices that define one (NVIDIA/Megatron-LM:
megatron/training/arguments.py): `normalization` ("LayerNorm" / "RMSNorm"), `swiglu`,
`position_embedding_type` ("learned_absolute" / "rope"; older runs
`use_rotary_position_embeddings`), sizes (`hidden_size`, `ffn_hidden_size`, `num_layers`,
`num_attention_heads`, `group_query_attention` + `num_query_groups`, `kv_channels`), `norm_epsilon`
(older `layernorm_epsilon`), `rotary_base`, `untie_embeddings_and_output_weights`,
`max_position_embeddings` (else `seq_length`), and the vocabulary: `padded_vocab_size` rows are
stored, `vocab_size` of them real (absent in many runs: then the given `--config` says it).
Llama's layout splits three ways by its attention: q/k/v biases alone (`--add-qkv-bias`, with
`add_bias_linear` false: Qwen2), per-head q/k norms (`--qk-layernorm`: Qwen3), or neither
(Llama). Megatron's linear_qkv has a bias when `add_bias_linear or add_qkv_bias`
(megatron/core/transformer/attention.py `SelfAttention.__init__`).

Mixture-of-experts runs (`--num-experts`, `--moe-router-topk`, `--moe-ffn-hidden-size`,
`--moe-router-pre-softmax`) are Mixtral (Llama's attention) or Qwen3-MoE (`--qk-layernorm`);
with multi-latent attention (`--multi-latent-attention`), a sigmoid router with an expert bias
and shared experts they are DeepSeek V3 (`moe_config`: the router's facts, dense layers from
`--moe-layer-freq`: Qwen3-MoE's `mlp_only_layers`, DeepSeek's `first_k_dense_replace`).

`ARCHITECTURES` says which HF architecture a set of those choices is and which `config.json` key
each size goes to; the HF dict is read by `models.config_from_hf`, so the model config is the
family's own. `FAMILY_RULES`, keyed by the family that config belongs to, names the rules file
from Megatron's (mcore, global, TP-merged) names to HF names and the remarks `inspect` shows;
the rule variables are the family's (`models.rule_variables`) plus Megatron's own
(`padded_vocab`, `swiglu`, `tied`, `te_norms`). A family without an entry is a FormatError.
Refused outright: interleaved (Meta-style) RoPE, partial RoPE, `apply_layernorm_1p` norms.

RoPE scaling (`_rope_scaling`, HF's `rope_scaling` dict), as Megatron's `RotaryEmbedding` computes
it (megatron/core/models/common/embeddings/rotary_pos_embedding.py):
- `--use-rope-scaling` with `--rope-scaling-factor F` (default 8.0): `_apply_scaling` is Llama
  3.x's, with its other constants fixed (`low_freq_factor` 1, `high_freq_factor` 4,
  `original_max_position_embeddings` 8192): HF's `{"rope_type": "llama3", "factor": F, ...}`;
- `--rotary-seq-len-interpolation-factor F`: positions divided by F before the frequencies, HF's
  `{"rope_type": "linear", "factor": F}`;
both at once is refused (HF has no dict for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.megatron.layout import arg
from hybridckpt.formats.megatron.moe_config import deepseek_v3_hf, dense_layers, routing_facts


@dataclass(frozen=True)
class Architecture:
    """An HF architecture Megatron args can describe.

    hf_architecture: the `architectures` entry of its config.json
    description:     how error messages name it ("Llama", "GPT-2")
    normalization, swiglu, position_embedding: the args that select it
    hf_keys:         our name of a value read from args (`_values`) -> its config.json key
    attention:       facts about the attention (`_attention_facts`) the args must agree with;
                     a fact the args do not record (an older Megatron) is not checked
    moe:             routed experts (`--num-experts`)
    routing:         facts about the router and the MoE layers (`moe_config.routing_facts`)
                     the args must agree with
    mla:             multi-latent attention (`--multi-latent-attention`)
    hf_extra:        more config.json keys, from args (DeepSeek V3's MLA and router)
    """

    hf_architecture: str
    description: str
    normalization: str
    swiglu: bool
    position_embedding: str
    hf_keys: Mapping[str, str]
    attention: Mapping[str, bool] = field(default_factory=dict)
    moe: bool = False
    routing: Mapping[str, bool] = field(default_factory=dict)
    mla: bool = False
    hf_extra: Callable[[Any, str], dict] | None = None

    def summary(self) -> str:
        act = "SwiGLU" if self.swiglu else "GELU"
        extra = "".join(f", {k}={v}" for k, v in self.attention.items() if v)
        extra += ", experts" if self.moe else ""
        extra += ", multi-latent attention" if self.mla else ""
        extra += "".join(f", {k}={v}" for k, v in self.routing.items())
        return f"{self.description} ({self.normalization}, {act}, {self.position_embedding}{extra})"

    def matches(
        self,
        swiglu: bool,
        norm: str,
        pos: str,
        attention: Mapping[str, bool | None],
        moe: bool = False,
        routing: Mapping[str, bool | None] | None = None,
        mla: bool = False,
    ) -> bool:
        """The args' choices are this architecture's (unrecorded attention facts pass)."""
        if (self.swiglu, self.normalization, self.position_embedding) != (swiglu, norm, pos):
            return False
        if (self.moe, self.mla) != (moe, mla):
            return False
        if not all((routing or {}).get(k) in (None, want) for k, want in self.routing.items()):
            return False
        return all(attention.get(k) in (None, want) for k, want in self.attention.items())


# Llama's config.json keys, shared by the families built on its layout (Qwen2, Qwen3)
LLAMA_HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tied": "tie_word_embeddings",
    "max_positions": "max_position_embeddings",
}

# Mixture-of-experts (`--num-experts`): the experts' size is `moe_ffn_hidden_size`; Mixtral has
# no dense MLP, so its `intermediate_size` is the experts'. Megatron's default router (top-k of
# the logits, then a softmax over the k: moe/moe_utils.py `topk_routing_with_score_function`,
# `use_pre_softmax=False`) equals HF's softmax over all experts, top-k, renormalised (Mixtral;
# Qwen3-MoE `norm_topk_prob=True`); `--moe-router-pre-softmax` (softmax, top-k, no
# renormalisation) is Qwen3-MoE's `norm_topk_prob=False` (Megatron-Bridge qwen3_moe_bridge.py:
# `moe_router_pre_softmax = not norm_topk_prob`).
# Mixtral and Qwen3-MoE: a softmax router over routed experts only
SOFTMAX_ROUTER = {
    "sigmoid": False,
    "expert_bias": False,
    "shared_experts": False,
    "grouped": False,
    "scaled": False,
}
MIXTRAL_HF_KEYS = {
    **{k: v for k, v in LLAMA_HF_KEYS.items() if k != "ffn_hidden_size"},
    "moe_ffn_hidden_size": "intermediate_size",
    "num_experts": "num_local_experts",
    "moe_topk": "num_experts_per_tok",
}
QWEN3_MOE_HF_KEYS = {
    **LLAMA_HF_KEYS,
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "num_experts": "num_experts",
    "moe_topk": "num_experts_per_tok",
    "norm_topk_prob": "norm_topk_prob",
    "mlp_only_layers": "mlp_only_layers",
}

ARCHITECTURES = (
    Architecture(
        "LlamaForCausalLM",
        "Llama",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys=LLAMA_HF_KEYS,
        attention={"qkv_bias": False, "qk_layernorm": False},
    ),
    Architecture(
        "Qwen2ForCausalLM",
        "Qwen2",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys=LLAMA_HF_KEYS,
        attention={"qkv_bias": True, "linear_bias": False, "qk_layernorm": False},
    ),
    Architecture(
        "Qwen3ForCausalLM",
        "Qwen3",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys=LLAMA_HF_KEYS,
        attention={"qkv_bias": False, "qk_layernorm": True},
    ),
    Architecture(
        "MixtralForCausalLM",
        "Mixtral",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys=MIXTRAL_HF_KEYS,
        attention={"qkv_bias": False, "qk_layernorm": False},
        moe=True,
        routing={"pre_softmax": False, "dense_layers": False, **SOFTMAX_ROUTER},
    ),
    Architecture(
        "Qwen3MoeForCausalLM",
        "Qwen3-MoE",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys=QWEN3_MOE_HF_KEYS,
        attention={"qkv_bias": False, "qk_layernorm": True},
        moe=True,
        routing=SOFTMAX_ROUTER,
    ),
    Architecture(
        "DeepseekV3ForCausalLM",
        "DeepSeek V3",
        normalization="RMSNorm",
        swiglu=True,
        position_embedding="rope",
        hf_keys={k: v for k, v in LLAMA_HF_KEYS.items() if k not in ("head_dim",)},
        attention={"qkv_bias": False},
        moe=True,
        routing={"sigmoid": True, "expert_bias": True, "shared_experts": True},
        mla=True,
        hf_extra=deepseek_v3_hf,
    ),
    Architecture(
        "GPT2LMHeadModel",
        "GPT-2",
        normalization="LayerNorm",
        swiglu=False,
        position_embedding="learned_absolute",
        hf_keys={
            "vocab_size": "vocab_size",
            "hidden_size": "n_embd",
            "ffn_hidden_size": "n_inner",
            "num_layers": "n_layer",
            "num_heads": "n_head",
            "norm_eps": "layer_norm_epsilon",
            "max_positions": "n_positions",
        },
    ),
)


@dataclass(frozen=True)
class Note:
    """A remark for `inspect`, made when every fact in `when` has the given value (facts: the
    rule variables plus `openai_gelu`)."""

    when: Mapping[str, Any]
    text: str


@dataclass(frozen=True)
class FamilyRules:
    """How a family's Megatron names map to HF: `hf_rules` (a file in formats/rules/) and the
    remarks that go with them."""

    hf_rules: str
    notes: tuple[Note, ...] = field(default=())


FAMILY_RULES: Mapping[str, FamilyRules] = {
    "llama": FamilyRules("megatron_llama.rules"),
    "mixtral": FamilyRules("megatron_mixtral.rules"),
    "qwen3_moe": FamilyRules("megatron_qwen3_moe.rules"),
    "deepseek_v3": FamilyRules("megatron_deepseek_v3.rules"),
    "qwen2": FamilyRules("megatron_qwen2.rules"),
    "qwen3": FamilyRules("megatron_qwen3.rules"),
    "gpt2": FamilyRules(
        "megatron_gpt2.rules",
        notes=(
            Note(
                {"openai_gelu": False},
                "Megatron's GELU is erf-based (F.gelu); GPT2LMHeadModel uses gelu_new (tanh "
                "approximation)",
            ),
            Note(
                {"tied": False},
                "untied output layer: GPT2LMHeadModel ties lm_head to wte and ignores "
                "lm_head.weight",
            ),
        ),
    ),
}


def family_rules(cfg, file: str) -> FamilyRules:
    """The entry of `FAMILY_RULES` for `cfg`'s family; a FormatError when Megatron has none."""
    entry = FAMILY_RULES.get(cfg.family)
    if entry is None:
        raise FormatError(
            f"{file}: the model is a {cfg.family} ({type(cfg).__name__}); Megatron checkpoints "
            f"are read for the families {sorted(FAMILY_RULES)}"
        )
    return entry


def notes_for(entry: FamilyRules, facts: Mapping[str, Any]) -> list[str]:
    """The entry's remarks whose conditions `facts` meet."""
    return [n.text for n in entry.notes if all(facts.get(k) == v for k, v in n.when.items())]


# -- architecture from args -------------------------------------------------------------------------


def architecture(args, file: str) -> Architecture:
    """The entry of `ARCHITECTURES` the args describe (FormatError naming them when none)."""
    norm = arg(args, "normalization", "LayerNorm")
    pos = arg(args, "position_embedding_type")
    if pos is None:
        pos = "rope" if arg(args, "use_rotary_position_embeddings") else "learned_absolute"
    swiglu = bool(arg(args, "swiglu", False))
    if arg(args, "rotary_interleaved"):
        raise FormatError(
            f"{file}: args.rotary_interleaved=True (Meta-style RoPE pairs) is not supported"
        )
    if pos == "rope" and (arg(args, "rotary_percent", 1.0) or 1.0) != 1.0:
        raise FormatError(
            f"{file}: args.rotary_percent={arg(args, 'rotary_percent')} (partial RoPE) is not supported"
        )
    if arg(args, "apply_layernorm_1p"):
        raise FormatError(
            f"{file}: args.apply_layernorm_1p=True (norm weights stored minus 1) is not supported"
        )
    attention = _attention_facts(args)
    moe = bool(arg(args, "num_experts"))
    routing = routing_facts(args, file) if moe else {}
    mla = bool(arg(args, "multi_latent_attention", False))
    for a in ARCHITECTURES:
        if a.matches(swiglu, norm, pos, attention, moe, routing, mla):
            return a
    recorded = "".join(f", {k}={v}" for k, v in attention.items() if v is not None)
    recorded += f", num_experts={arg(args, 'num_experts')}" if moe else ""
    recorded += ", multi_latent_attention=True" if mla else ""
    recorded += "".join(f", {k}={v}" for k, v in routing.items())
    raise FormatError(
        f"{file}: args describe normalization={norm}, swiglu={swiglu}, position_embedding_type={pos}"
        f"{recorded}: neither {' nor '.join(a.summary() for a in ARCHITECTURES)}"
    )


def _attention_facts(args) -> dict[str, bool | None]:
    """qkv_bias (`add_qkv_bias or add_bias_linear`), linear_bias (`add_bias_linear`) and
    qk_layernorm (`qk_layernorm`) as the args record them; None where they do not."""
    linear, qkv = arg(args, "add_bias_linear"), arg(args, "add_qkv_bias")
    recorded = [bool(x) for x in (linear, qkv) if x is not None]
    qk_norm = arg(args, "qk_layernorm")
    return {
        "qkv_bias": any(recorded) if recorded else None,
        "linear_bias": None if linear is None else bool(linear),
        "qk_layernorm": None if qk_norm is None else bool(qk_norm),
    }


def _true_vocab(args, config, file: str) -> int:
    padded = arg(args, "padded_vocab_size")
    own = arg(args, "vocab_size")
    given = getattr(config, "vocab_size", None) if config is not None else None
    if isinstance(own, int) and isinstance(given, int) and own != given:
        raise ConfigError(f"{file}: args.vocab_size is {own} but the given config says {given}")
    vocab = own if isinstance(own, int) else given
    if vocab is None:
        raise FormatError(
            f"{file}: args.vocab_size is not set and the embedding holds padded_vocab_size={padded} "
            f"rows including Megatron's vocab padding; pass --config (the model's HF config.json) "
            f"to give the true vocabulary size"
        )
    if isinstance(padded, int) and vocab > padded:
        raise ConfigError(
            f"{file}: vocab_size {vocab} exceeds the checkpoint's padded_vocab_size {padded}"
        )
    return vocab


def _values(args, vocab: int) -> dict[str, Any]:
    """The model's sizes and options as args give them (None where args leave them to HF's
    defaults), under the names `Architecture.hf_keys` maps."""
    hidden, heads = arg(args, "hidden_size"), arg(args, "num_attention_heads")
    eps = arg(args, "norm_epsilon", None) or arg(args, "layernorm_epsilon", 1e-5)
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention") else heads
    head_dim = arg(args, "kv_channels")
    if not head_dim and isinstance(hidden, int) and isinstance(heads, int) and heads:
        head_dim = hidden // heads
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "ffn_hidden_size": arg(args, "ffn_hidden_size"),
        "num_layers": arg(args, "num_layers"),
        "num_heads": heads,
        "num_query_groups": groups or heads,
        "head_dim": head_dim,
        "norm_eps": float(eps),
        "rope_theta": float(arg(args, "rotary_base", 10000) or 10000),
        "tied": not arg(args, "untie_embeddings_and_output_weights", False),
        "max_positions": arg(args, "max_position_embeddings") or arg(args, "seq_length") or 2048,
        "num_experts": arg(args, "num_experts"),
        "moe_topk": arg(args, "moe_router_topk", 2) or 2,
        "moe_ffn_hidden_size": arg(args, "moe_ffn_hidden_size") or arg(args, "ffn_hidden_size"),
        "norm_topk_prob": not arg(args, "moe_router_pre_softmax", False),
        "mlp_only_layers": dense_layers(args, "args") if arg(args, "num_experts") else [],
    }


# Megatron's `_apply_scaling` defaults, not recorded in args (rotary_pos_embedding.py)
MEGATRON_LLAMA3_SCALING = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_scaling(args, file: str) -> dict[str, Any] | None:
    """HF's `rope_scaling` dict for the args' RoPE scaling (module docstring); None for plain RoPE."""
    llama3 = bool(arg(args, "use_rope_scaling", False))
    linear = arg(args, "rotary_seq_len_interpolation_factor")
    if llama3 and linear:
        raise FormatError(
            f"{file}: args set both use_rope_scaling (Llama 3.x scaling) and "
            f"rotary_seq_len_interpolation_factor={linear}; no HF rope_scaling expresses both"
        )
    if llama3:
        factor = float(arg(args, "rope_scaling_factor", 8.0) or 8.0)
        return {"rope_type": "llama3", "factor": factor, **MEGATRON_LLAMA3_SCALING}
    if linear:
        return {"rope_type": "linear", "factor": float(linear)}
    return None


def hf_config(args, config, file: str) -> dict[str, Any]:
    """The HF `config.json` dict `args` describe (true vocab from args or the given `config`)."""
    a = architecture(args, file)
    values = _values(args, _true_vocab(args, config, file))
    out = {"architectures": [a.hf_architecture], **{k: values[v] for v, k in a.hf_keys.items()}}
    if a.hf_extra is not None:
        out.update(a.hf_extra(args, file))
    # MLA's RoPE (yarn) is its architecture's `hf_extra`
    scaling = _rope_scaling(args, file) if a.position_embedding == "rope" and not a.mla else None
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def model_config(args, config, file: str):
    """The model config (`models.config_from_hf` of `hf_config`); a given `config` must agree
    with it field by field."""
    from hybridckpt import models

    cfg = models.config_from_hf(hf_config(args, config, file), source=file)
    if config is not None:
        _check_config(cfg, config, file)
    return cfg


def _check_config(cfg, given, file: str) -> None:
    if type(given) is not type(cfg):
        raise ConfigError(
            f"{file}: args describe a {type(cfg).__name__} but the given config is a {type(given).__name__}"
        )
    for f in dataclasses.fields(cfg):
        mine, theirs = getattr(cfg, f.name), getattr(given, f.name)
        if mine != theirs:
            raise ConfigError(
                f"{file}: args give {f.name}={mine} but the given config says {theirs}"
            )
