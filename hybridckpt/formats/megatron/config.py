"""The model a Megatron-LM checkpoint holds, from its `args`: an HF config and the rules to HF names.

Megatron records no architecture name, only the choices that define one (NVIDIA/Megatron-LM:
megatron/training/arguments.py): `normalization` ("LayerNorm" / "RMSNorm"), `swiglu`,
`position_embedding_type` ("learned_absolute" / "rope"; older runs
`use_rotary_position_embeddings`), sizes (`hidden_size`, `ffn_hidden_size`, `num_layers`,
`num_attention_heads`, `group_query_attention` + `num_query_groups`, `kv_channels`), `norm_epsilon`
(older `layernorm_epsilon`), `rotary_base`, `untie_embeddings_and_output_weights`,
`max_position_embeddings` (else `seq_length`), and the vocabulary: `padded_vocab_size` rows are
stored, `vocab_size` of them real (absent in many runs: then the given `--config` says it).
Megatron's linear_qkv has a bias when `add_bias_linear or add_qkv_bias`
(megatron/core/transformer/attention.py `SelfAttention.__init__`). Mixture-of-experts runs
(`--num-experts`) add the router's facts and the dense layers (`moe_config`).

Which family those choices describe is the family's to say, not this module's: a family Megatron
trains has a megatron dialect (`models/<family>/dialects/megatron.py`, its matcher, and
`megatron.rules`, Megatron's mcore, global, TP-merged names -> its HF names), found through the
registry (`models.dialects("megatron")`). Here the args become facts and values (Megatron's own
semantics); each family's matcher says which facts are its own and where each value goes:
- `DESCRIPTION`: how messages name it ("Llama");
- `MATCH`: fact -> the value the args must show. Facts (`facts`): normalization, swiglu,
  position_embedding, qkv_bias, linear_bias, qk_layernorm, moe (`--num-experts`), mla
  (`--multi-latent-attention`) and, with experts, the router's (`moe_config.routing_facts`:
  pre_softmax, dense_layers, sigmoid, expert_bias, shared_experts, grouped, scaled); any other
  key is an args attribute, compared as saved. `moe` and `mla` are False unless the matcher says
  otherwise. A fact the args do not record (an older Megatron) passes; when several families
  fit, the one that wants every unrecorded fact False (the feature absent) is taken, and a tie
  beyond that is refused;
- `HF_KEYS`: a value (`_values`: vocab_size, hidden_size, ffn_hidden_size, num_layers,
  num_heads, num_query_groups, head_dim, norm_eps, rope_theta, tied, max_positions,
  num_experts, moe_topk, moe_ffn_hidden_size, norm_topk_prob, dense_layers) -> its config.json
  key; the config.json `architectures` is the family's first HF architecture;
- `NOTES` (optional): `(when, text)` remarks for `inspect`, made when every fact in `when` has
  the given value (facts: the rule variables plus `openai_gelu`);
- `hf_extra(arg, values, file)` (optional): more config.json keys the args give (DeepSeek V3's
  MLA and router); `arg(name, default=None)` reads the args;
- `ROTARY_PERCENT` (optional): the config.json key taking `--rotary-percent` (partial RoPE:
  Megatron turns the first `int(kv_channels * rotary_percent)` dims of each head, half-split,
  GLM-4.5's `partial_rotary_factor`); a family without it refuses rotary_percent != 1;
- `ROTARY_INTERLEAVED` (optional, False): the family's own RoPE turns adjacent pairs, as
  `--rotary-interleaved` does (Llama 4's complex pairs); a family without it refuses the flag;
- `ZERO_CENTERED_NORMS` (optional, False): the family's HF norms are themselves zero-centred
  ((1+w), Qwen3-Next), so `--apply-layernorm-1p` (Bridge's `layernorm_zero_centered_gamma`)
  stores them as HF does; a family without it refuses the flag.
The HF dict is read by `models.config_from_hf`, so the model config is the family's own; the
rule variables are the family's (`models.rule_variables`) plus Megatron's own (`padded_vocab`,
`swiglu`, `tied`, `te_norms`). A family without a megatron dialect is a FormatError.
Refused outright: `apply_layernorm_1p` norms unless the family's are zero-centred too
(`ZERO_CENTERED_NORMS`); partial RoPE unless the family says where it goes
(`ROTARY_PERCENT`); interleaved (Meta-style) RoPE unless the family rotates pairs
(`ROTARY_INTERLEAVED`).

RoPE scaling (`_rope_scaling`, HF's `rope_scaling` dict), as Megatron's `RotaryEmbedding` computes
it (megatron/core/models/common/embeddings/rotary_pos_embedding.py):
- `--use-rope-scaling` with `--rope-scaling-factor F` (default 8.0): `_apply_scaling` is Llama
  3.x's, with its other constants fixed (`low_freq_factor` 1, `high_freq_factor` 4,
  `original_max_position_embeddings` 8192): HF's `{"rope_type": "llama3", "factor": F, ...}`;
- `--rotary-seq-len-interpolation-factor F`: positions divided by F before the frequencies, HF's
  `{"rope_type": "linear", "factor": F}`;
both at once is refused (HF has no dict for it). Multi-latent attention rotates its own way
(`--rope-type yarn`): its family's `hf_extra` says it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridckpt import models
from hybridckpt.errors import ConfigError, FormatError
from hybridckpt.formats.megatron.layout import arg
from hybridckpt.formats.megatron.moe_config import dense_layers, routing_facts
from hybridckpt.models.dialect import most_specific

DIALECT = "megatron"  # models/<family>/dialects/megatron.{py,rules}
# the facts every matcher has, whether it names them or not
FACT_DEFAULTS = {"moe": False, "mla": False}
_BASE = ("normalization", "swiglu", "position_embedding")
_ATTENTION = ("qkv_bias", "linear_bias", "qk_layernorm")


@dataclass(frozen=True)
class Architecture:
    """A family's megatron dialect, as this module reads it (see the module docstring).

    family:          the family's name
    hf_architecture: the `architectures` entry of the config.json the args give
    description:     how messages name it ("Llama", "GPT-2")
    match:           fact -> value the args must show (`FACT_DEFAULTS` filled in)
    hf_keys:         a value read from args (`_values`) -> its config.json key
    hf_extra:        more config.json keys, from args (`hf_extra(arg, values, file)`)
    rotary_percent:  the config.json key taking `args.rotary_percent` (partial RoPE), or None
                     (a family without it refuses a rotary_percent other than 1)
    rotary_interleaved: the family's RoPE turns adjacent pairs (Meta's complex pairs), as
                     `--rotary-interleaved` does (a family without it refuses that flag)
    zero_centered_norms: the family's HF norms are (1+w) (`--apply-layernorm-1p` read as stored)
    notes:           `(when, text)` remarks for `inspect`
    dialect:         the registry's record (its rules: `dialect.rules()`)
    """

    family: str
    hf_architecture: str
    description: str
    match: Mapping[str, Any]
    hf_keys: Mapping[str, str]
    hf_extra: Callable[..., dict] | None
    rotary_percent: str | None
    rotary_interleaved: bool
    zero_centered_norms: bool
    notes: tuple[tuple[Mapping[str, Any], str], ...]
    dialect: models.Dialect

    @property
    def swiglu(self) -> bool:
        return bool(self.match.get("swiglu"))

    @property
    def position_embedding(self) -> str:
        return self.match.get("position_embedding")

    def summary(self) -> str:
        act = "SwiGLU" if self.swiglu else "GELU"
        m = self.match
        extra = ", experts" if m.get("moe") else ""
        extra += ", multi-latent attention" if m.get("mla") else ""
        extra += "".join(
            f", {k}={v}" for k, v in m.items() if k not in (*_BASE, *FACT_DEFAULTS) and v
        )
        return f"{self.description} ({m.get('normalization')}, {act}, {m.get('position_embedding')}{extra})"

    def score(self, facts: Mapping[str, Any]) -> int | None:
        """None when the args' facts contradict this family's; else minus the number of facts
        the args do not record that this family wants other than False (module docstring)."""
        if any(facts.get(k) not in (None, want) for k, want in self.match.items()):
            return None
        return -sum(facts.get(k) is None and want is not False for k, want in self.match.items())


def _architecture(fam: models.Family, d: models.Dialect) -> Architecture:
    family = fam.name
    match = {**FACT_DEFAULTS, **dict(d.get("MATCH") or {})}
    missing = [k for k in _BASE if k not in match]
    if missing or not isinstance(d.get("HF_KEYS"), Mapping):
        raise ConfigError(
            f"{d.package}.{d.name}: a megatron matcher needs MATCH with {list(_BASE)} (missing "
            f"{missing}) and HF_KEYS"
        )
    return Architecture(
        family=family,
        hf_architecture=fam.hf_architectures[0],
        description=d.get("DESCRIPTION", family),
        match=match,
        hf_keys=dict(d.get("HF_KEYS")),
        hf_extra=d.get("hf_extra"),
        rotary_percent=d.get("ROTARY_PERCENT"),
        rotary_interleaved=bool(d.get("ROTARY_INTERLEAVED", False)),
        zero_centered_norms=bool(d.get("ZERO_CENTERED_NORMS", False)),
        notes=tuple(d.get("NOTES", ())),
        dialect=d,
    )


def architectures() -> tuple[Architecture, ...]:
    """Every family's megatron dialect (families in the registry's order). Only the families
    whose folder holds the dialect are imported (`models.speaking`: 11 of the 27 packages):
    looking each up with `family_named` imported every family, about 40 ms of an import's open."""
    return tuple(_architecture(fam, d) for fam in models.speaking(DIALECT).values()
                 if (d := fam.dialect(DIALECT)) is not None)


def family_architecture(cfg, file: str) -> Architecture:
    """The megatron dialect of `cfg`'s family; a FormatError when it has none."""
    fam = models.family_of(cfg)
    d = fam.dialect(DIALECT)
    if d is None:
        raise FormatError(
            f"{file}: the model is a {fam.name} ({type(cfg).__name__}); Megatron checkpoints "
            f"are read for the families {sorted(models.dialects(DIALECT))}"
        )
    return _architecture(fam, d)


def notes_for(a: Architecture, facts: Mapping[str, Any]) -> list[str]:
    """The family's remarks whose conditions `facts` meet."""
    return [text for when, text in a.notes if all(facts.get(k) == v for k, v in when.items())]


# -- architecture from args -------------------------------------------------------------------------


def facts(args, file: str) -> dict[str, Any]:
    """What the args say about the architecture (module docstring); None where unrecorded."""
    pos = arg(args, "position_embedding_type")
    if pos is None:
        pos = "rope" if arg(args, "use_rotary_position_embeddings") else "learned_absolute"
    moe = bool(arg(args, "num_experts"))
    return {
        "normalization": arg(args, "normalization", "LayerNorm"),
        "swiglu": bool(arg(args, "swiglu", False)),
        "position_embedding": pos,
        **_attention_facts(args),
        "moe": moe,
        "mla": bool(arg(args, "multi_latent_attention", False)),
        **(routing_facts(args, file) if moe else {}),
    }


def architecture(args, file: str) -> Architecture:
    """The family the args describe (FormatError naming them when none, or several alike)."""
    f = facts(args, file)
    known = architectures()
    scores = {}
    for a in known:
        extra = {k: arg(args, k) for k in a.match if k not in f}  # other args, as saved
        scores[a.family] = a.score({**f, **extra})
    best = most_specific(scores)
    if len(best) == 1:
        a = next(a for a in known if a.family == best[0])
        if arg(args, "apply_layernorm_1p") and not a.zero_centered_norms:
            raise FormatError(
                f"{file}: args.apply_layernorm_1p=True (norm weights stored minus 1) is not "
                f"supported for {a.description} (read for the families "
                f"{sorted(k.family for k in known if k.zero_centered_norms)})"
            )
        if arg(args, "rotary_interleaved") and not a.rotary_interleaved:
            raise FormatError(
                f"{file}: args.rotary_interleaved=True (Meta-style RoPE pairs) is not supported "
                f"for {a.description} (read for the families "
                f"{sorted(k.family for k in known if k.rotary_interleaved)})"
            )
        if f["position_embedding"] == "rope" and _rotary_percent(args) != 1.0 and a.rotary_percent is None:
            raise FormatError(
                f"{file}: args.rotary_percent={arg(args, 'rotary_percent')} (partial RoPE) is not "
                f"supported for {a.description} (read for the families "
                f"{sorted(k.family for k in known if k.rotary_percent)})"
            )
        return a
    routing = {k: v for k, v in f.items() if k not in (*_BASE, *_ATTENTION, "moe", "mla")}
    recorded = "".join(f", {k}={f[k]}" for k in _ATTENTION if f[k] is not None)
    recorded += f", num_experts={arg(args, 'num_experts')}" if f["moe"] else ""
    recorded += ", multi_latent_attention=True" if f["mla"] else ""
    recorded += "".join(f", {k}={v}" for k, v in routing.items())
    described = (
        f"{file}: args describe normalization={f['normalization']}, swiglu={f['swiglu']}, "
        f"position_embedding_type={f['position_embedding']}{recorded}"
    )
    if best:
        raise FormatError(f"{described}: the families {best} fit alike")
    raise FormatError(f"{described}: neither {' nor '.join(a.summary() for a in known)}")


def _rotary_percent(args) -> float:
    return float(arg(args, "rotary_percent", 1.0) or 1.0)


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
        "dense_layers": dense_layers(args, "args") if arg(args, "num_experts") else [],
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
    return _hf_config(architecture(args, file), args, config, file)


def _hf_config(a: Architecture, args, config, file: str) -> dict[str, Any]:
    """`hf_config` for the family `a` the args describe."""
    values = _values(args, _true_vocab(args, config, file))
    unknown = sorted(set(a.hf_keys) - set(values))
    if unknown:
        raise ConfigError(
            f"{a.dialect.package}.{a.dialect.name}: HF_KEYS names values {unknown}; the args "
            f"give {sorted(values)}"
        )
    out = {"architectures": [a.hf_architecture], **{k: values[v] for v, k in a.hf_keys.items()}}
    if a.hf_extra is not None:
        out.update(a.hf_extra(lambda name, default=None: arg(args, name, default), values, file))
    if a.rotary_percent is not None and a.position_embedding == "rope":
        out[a.rotary_percent] = _rotary_percent(args)
    # multi-latent attention rotates its own way (yarn): its family's `hf_extra` says how
    mla = bool(arg(args, "multi_latent_attention", False))
    scaling = _rope_scaling(args, file) if a.position_embedding == "rope" and not mla else None
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def model_config(args, config, file: str):
    """The model config (`models.config_from_hf` of `hf_config`); a given `config` must agree
    with it field by field."""
    a = architecture(args, file)
    # read by the family the args describe, imported alone: `models.config_from_hf` would find
    # it by its HF architecture among every family, importing the 27 packages (~35 ms of an open)
    fam = models.speaking(DIALECT)[a.family]
    cfg = fam.config_from_hf(_hf_config(a, args, config, file), file)
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
