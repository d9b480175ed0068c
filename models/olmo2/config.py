"""OLMo 2 family config and its HF form and rule variables (no JAX).

Olmo2ForCausalLM (huggingface/transformers:src/transformers/models/olmo2/modeling_olmo2.py and
configuration_olmo2.py) is Llama's attention, RoPE and SwiGLU with two changes:
- norms after, not before: each block is `x + post_attention_layernorm(attn(x))` then
  `x + post_feedforward_layernorm(mlp(x))`; the sublayers see the residual stream unnormalised
  (no `input_layernorm`; `post_attention_layernorm` is a post-norm here, not Llama's pre-MLP
  norm);
- q and k RMS-normalised over the whole projection (`q_norm` of size heads * head_dim, `k_norm`
  of size kv_heads * head_dim), after the projections and before RoPE (Qwen3 normalises each
  head instead).

HF `config.json` (`from_hf` / `to_hf`): architectures `Olmo2ForCausalLM` (or, with no
`architectures`, `model_type` "olmo2"), read by Llama's reader (sizes, RoPE of any type
`models.rope` implements); transformers' Olmo2Config defaults `rms_norm_eps` to 1e-5 (Llama's to
1e-6), used when the key is absent; `attention_bias: true` is refused as for Llama (no release
has it).

`post_norms` and `qk_norm_whole` are the family's two facts, as properties (always true): a test
turns each off to show it matters (`models.olmo2.module` then applies the norms before the
sublayers, or per head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridckpt.models.llama import config as llama

ARCHITECTURE = "Olmo2ForCausalLM"
MODEL_TYPE = "olmo2"
HF_DEFAULT_EPS = 1e-5  # transformers' Olmo2Config.rms_norm_eps


@dataclasses.dataclass(frozen=True)
class Olmo2Config(llama.LlamaConfig):
    """OLMo 2: LlamaConfig's fields; post-norms only, q/k RMSNorm over the whole projection."""

    @property
    def family(self) -> str:
        return "olmo2"

    @property
    def post_norms(self) -> bool:
        """Norms after the attention and the MLP (inside the residual branch), none before."""
        return True

    @property
    def qk_norm_whole(self) -> bool:
        """q and k RMS-normalised over all heads at once (statistics over heads * head_dim)."""
        return True


def from_hf(d: Mapping[str, Any], source: str) -> Olmo2Config:
    """An Olmo2Config from an HF `config.json` dict; `source` names the file in errors."""
    view = dict(d)
    view.setdefault("rms_norm_eps", HF_DEFAULT_EPS)
    cfg = llama.from_hf(view, source)
    return Olmo2Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


def to_hf(cfg: Olmo2Config) -> dict[str, Any]:
    """A `config.json` dict transformers loads back as an Olmo2ForCausalLM (Llama's keys;
    `head_dim` and `mlp_bias` are no Olmo2Config fields: head_dim is written only when it is not
    hidden_size / num_heads)."""
    d = llama.to_hf(cfg) | {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
    del d["mlp_bias"]
    if cfg.head_dim * cfg.num_heads == cfg.hidden_size:
        del d["head_dim"]
    return d


def rule_variables(cfg: Olmo2Config) -> dict[str, Any]:
    """Variables a rules text may use (`models.family.RULE_VARIABLES`, as Llama's)."""
    return llama.rule_variables(cfg)
