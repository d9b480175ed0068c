"""Qwen3 (dense) family config and its HF form and rule variables (no JAX).

Qwen3ForCausalLM is Llama with q and k RMS-normalised per head (`q_norm`, `k_norm`, weights of
size head_dim, applied after the projection and before RoPE) and an explicit `head_dim` that may
differ from hidden_size / num_heads, read from
huggingface/transformers:src/transformers/models/qwen3/modeling_qwen3.py (`Qwen3Attention`) and
configuration_qwen3.py. `attention_bias` (default false, false in released models) puts biases
on all four projections q, k, v and o.

HF `config.json` (`from_hf` / `to_hf`): architectures `Qwen3ForCausalLM` (or, when
`architectures` is absent, `model_type` "qwen3"). The fields shared with Llama are read by
Llama's reader through `models.qwen2.config.llama_fields` (RoPE parsed as for Llama; sliding
window refused as for Qwen2); `head_dim` absent means transformers' default 128, not
hidden_size / num_heads.

Params: `models.qwen3.params` (Llama's plus `layers.{q,k}_norm.scale` `[L, head_dim]` and, with
`attention_bias`, `layers.{q,k,v,o}.bias`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.llama import config as llama
from hybridckpt.models.qwen2.config import llama_fields, llama_to_hf

ARCHITECTURE = "Qwen3ForCausalLM"
HF_DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config.head_dim when config.json has none


@dataclasses.dataclass(frozen=True)
class Qwen3Config(llama.LlamaConfig):
    """Qwen3 (dense): LlamaConfig's fields plus `attention_bias` (biases on q, k, v and o);
    q and k are RMS-normalised per head."""

    attention_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "attention_bias", bool(self.attention_bias))

    @property
    def family(self) -> str:
        return "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """q, k, v projections have biases (`layers.{q,k,v}.bias`)."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """The output projection has a bias (`layers.o.bias`)."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """q and k are RMS-normalised per head before RoPE (`layers.{q,k}_norm.scale`)."""
        return True


def from_hf(d: Mapping[str, Any], source: str) -> Qwen3Config:
    """A Qwen3Config from an HF `config.json` dict; `source` names the file in errors."""
    overrides = {} if "head_dim" in d else {"head_dim": HF_DEFAULT_HEAD_DIM}
    fields = llama_fields(d, source, ARCHITECTURE, **overrides)
    return Qwen3Config(**fields, attention_bias=bool(d.get("attention_bias", False)))


def to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as a Qwen3ForCausalLM."""
    return llama_to_hf(cfg, ARCHITECTURE, "qwen3") | {"attention_bias": cfg.attention_bias}


def rule_variables(cfg: Qwen3Config) -> dict[str, Any]:
    """Llama's rule variables plus `attention_bias` (the param table's biases depend on it)."""
    return llama.rule_variables(cfg) | {"attention_bias": cfg.attention_bias}
