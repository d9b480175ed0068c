"""PaddleNLP's names for a model family: structured names, pipeline keys, and the rules to HF.

PaddleNLP saves a model under structured names `<prefix>.layers.0.self_attn.q_proj.weight`
(`prefix` is the model class's `base_model_prefix`; Linear weights `[in, out]`). What a family
needs here is the family's paddlenlp dialect (`models/<family>/dialects/paddlenlp.py`, found
through the registry): its `PREFIX`, the rules from structured names to HF names
(`paddlenlp.rules`, or the file its `RULES` names) and the rules of its tensor-parallel merges
(`paddlenlp_tp.rules` / `TP_RULES`; PaddlePaddle/PaddleNLP: paddlenlp/transformers/<family>/
modeling.py `_get_name_mappings`, `_get_tensor_parallel_mappings`). The Llama-like families
(Llama, Mistral, Qwen2, Qwen3) share Llama's pair of files, written on `{prefix}`. PaddleNLP has
no Gemma 2 / Gemma 3 (only Gemma 1, which hybridckpt does not implement), so those have no
dialect; PaddleFormers' unified checkpoints, under HF names, carry any family
(`formats/paddle/paddleformers.py`). A family without one is a FormatError naming those
PaddleNLP checkpoints are read for.

Rule variables: the family's own (`models.rule_variables`: heads, kv heads, tying, ...) plus
PaddleNLP's: `fuse_attention_qkv` / `fuse_attention_ffn` (its config flags, read off the tensor
names) and what TP `tp` splits (`vocab_split`: vocab % tp == 0; `kv_split`: kv heads % tp == 0).

Pipeline keys: a PipelineLayer (`<Family>ForCausalLMPipe`, paddlenlp/transformers/llama/
modeling_pp.py) numbers its sequential layers: desc 0 embedding (`prefix`), 1..L decoder layers
(`prefix.layers.i`), L+1 norm (`prefix`), L+2 LM head (`lm_head`); `single_card_name` renames
them as PaddleNLP's `_set_pipeline_name_mapping` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hybridckpt import models
from hybridckpt.errors import FormatError
from hybridckpt.io.config_file import config_beside
from hybridckpt.rules import RuleSet, parse_rules

DIALECT = "paddlenlp"  # models/<family>/dialects/paddlenlp.{py,rules}


@dataclass(frozen=True)
class PaddleFamily:
    """A model family as PaddleNLP saves it (its paddlenlp dialect).

    prefix:  the structured-name prefix of the base model (`base_model_prefix`)
    dialect: the registry's record: `dialect.rules()` from structured names to HF names,
             `dialect.rules("tp")` the merges of its tensor-parallel shards
    """

    prefix: str
    dialect: models.Dialect

    @property
    def hf_rules(self) -> str:
        """The rules text from structured names to HF names."""
        return self.dialect.rules_text()


def families() -> dict[str, PaddleFamily]:
    """Every family PaddleNLP checkpoints are read for, by name."""
    return {name: PaddleFamily(d.get("PREFIX"), d) for name, d in models.dialects(DIALECT).items()}


# the variables of a source's `rule_vars` (the rest come from the model config)
HF_RULE_VARS = (
    "num_heads", "num_kv_heads", "tied", "prefix", "fuse_attention_qkv", "fuse_attention_ffn",
)  # fmt: skip


def family(cfg, where: str = "") -> PaddleFamily:
    """The paddlenlp dialect of `cfg`'s family; a FormatError (naming `where`) when none."""
    known = families()
    entry = known.get(getattr(cfg, "family", None))
    if entry is None:
        at = f"{where}: " if where else ""
        if cfg is None:
            raise FormatError(
                f"{at}the config.json names an architecture hybridckpt does not know; a PaddleNLP "
                f"hybrid-parallel checkpoint's tp/pp layout (which dims each rank splits, which "
                f"layers each stage holds) comes from the model family, so it cannot be read "
                f"model-agnostic: families read: {sorted(known)}"
            )
        raise FormatError(
            f"{at}PaddleNLP checkpoints are read for the families {sorted(known)}; the config "
            f"is {type(cfg).__name__} ({getattr(cfg, 'family', '?')})"
        )
    return entry


def load_config(folder: str, config=None):
    """`config`, or the model config from `folder/config.json` (PaddleNLP writes HF-style keys)."""
    return config_beside(folder, config=config, required_for="a PaddleNLP checkpoint")


def rule_variables(cfg, tp: int = 1, *, fuse_qkv: bool = False, fuse_ffn: bool = False) -> dict:
    """Variables of the Paddle rules of `cfg`'s family: the family's own, its structured-name
    `prefix`, the fused layers, and what TP `tp` splits."""
    fam = family(cfg)
    v = models.rule_variables(cfg)
    return {
        **v,
        "prefix": fam.prefix,
        "tied": bool(v["tied"]),
        "vocab_split": v["vocab_size"] % tp == 0,
        "kv_split": v["num_kv_heads"] % tp == 0,
        "fuse_attention_qkv": bool(fuse_qkv),
        "fuse_attention_ffn": bool(fuse_ffn),
    }


def fused_flags(names: Iterable[str]) -> dict:
    """PaddleNLP's `fuse_attention_qkv` / `fuse_attention_ffn`, read off the tensor names."""
    names = list(names)
    return {
        "fuse_qkv": any(n.endswith(".self_attn.qkv_proj.weight") for n in names),
        "fuse_ffn": any(n.endswith(".mlp.gate_up_fused_proj.weight") for n in names),
    }


def hf_rule_vars(cfg, tensors: Iterable[str]) -> dict[str, Any]:
    """A source's `rule_vars`: the `HF_RULE_VARS` for this config and these (fused?) tensors."""
    variables = rule_variables(cfg, **fused_flags(tensors))
    return {k: v for k, v in variables.items() if k in HF_RULE_VARS}


def hf_rules(cfg, *, fuse_qkv: bool = False, fuse_ffn: bool = False) -> RuleSet:
    """Structured names -> HF names (the family's paddlenlp rules)."""
    variables = rule_variables(cfg, fuse_qkv=fuse_qkv, fuse_ffn=fuse_ffn)
    text, origin = family(cfg).dialect.rules()
    return parse_rules(text, variables, origin=origin)


def tp_rules(cfg, tp: int) -> RuleSet:
    """The family's tensor-parallel merges for `tp` ranks."""
    text, origin = family(cfg).dialect.rules("tp")
    return parse_rules(text, rule_variables(cfg, tp), origin=origin)


# -- pipeline descriptor names ------------------------------------------------------------------


def pp_prefixes(num_layers: int, prefix: str) -> dict[int, str]:
    """`<Family>ForCausalLMPipe`'s sequential layers (paddlenlp/transformers/llama/modeling_pp.py):
    desc 0 embedding (`prefix`), 1..L decoder layers (`prefix.layers.i`), L+1 norm (`prefix`),
    L+2 lm head ("lm_head")."""
    out = {0: prefix, num_layers + 1: prefix, num_layers + 2: "lm_head"}
    out.update({i + 1: f"{prefix}.layers.{i}" for i in range(num_layers)})
    return out


def single_card_name(key: str, num_layers: int, pp_rank: int, prefix: str) -> str:
    """A PipelineLayer key (`[_layers.]N.rest`, `[_layers.]C.N.rest` with virtual stages,
    `[_layers.]shared_layers.<name>.rest`) as PaddleNLP's `_set_pipeline_name_mapping` renames it;
    other keys unchanged. The shared (tied) layer is the embedding on pp stage 0 and the LM head
    on later stages."""
    parts = key.split(".")
    if parts[0] == "_layers":
        parts = parts[1:]
    if not parts or not (parts[0].isdigit() or parts[0] == "shared_layers"):
        return key
    prefixes = pp_prefixes(num_layers, prefix)
    if parts[0] == "shared_layers":
        if len(parts) < 3:
            return key
        head, rest = (prefix if pp_rank == 0 else "lm_head"), parts[2:]
    elif len(parts) > 2 and parts[1].isdigit():
        head, rest = prefixes.get(int(parts[0]) + int(parts[1])), parts[2:]
    else:
        head, rest = prefixes.get(int(parts[0])), parts[1:]
    if head is None:
        raise FormatError(f"pipeline key {key!r}: descriptor index outside 0..{num_layers + 2}")
    return ".".join([head, *rest])
