"""Param shapes of each family from its config alone: no JAX, nothing traced or allocated.

The trees are the ones the Flax modules build (see the `Params` lists in `models.llama` and
`models.gpt2`: fp32, kernels `[in, out]`, per-layer params stacked on a leading `[L]` axis).
Exports and name checks use these, so a conversion that never touches an accelerator never
imports JAX; `tests/test_models.py` checks them against `jax.eval_shape` of each module's init.
"""

from __future__ import annotations

from hybridckpt.errors import ConfigError
from models.config import GPT2Config, LlamaConfig, ModelConfig

Shape = tuple[int, ...]


def _llama(cfg: LlamaConfig) -> dict:
    L, E, M, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    tree = {
        "embed": {"embedding": (V, E)},
        "layers": {
            "attn_norm": {"scale": (L, E)},
            "mlp_norm": {"scale": (L, E)},
            "q": {"kernel": (L, E, q)},
            "k": {"kernel": (L, E, kv)},
            "v": {"kernel": (L, E, kv)},
            "o": {"kernel": (L, q, E)},
            "gate": {"kernel": (L, E, M)},
            "up": {"kernel": (L, E, M)},
            "down": {"kernel": (L, M, E)},
        },
        "final_norm": {"scale": (E,)},
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": (E, V)}
    return tree


def _gpt2(cfg: GPT2Config) -> dict:
    L, E, inner = cfg.n_layer, cfg.n_embd, cfg.n_inner

    def norm(*lead: int) -> dict:
        return {"scale": (*lead, E), "bias": (*lead, E)}

    return {
        "wte": {"embedding": (cfg.vocab_size, E)},
        "wpe": {"embedding": (cfg.n_positions, E)},
        "layers": {
            "ln_1": norm(L),
            "ln_2": norm(L),
            "qkv": {"kernel": (L, E, 3, E), "bias": (L, 3, E)},
            "attn_out": {"kernel": (L, E, E), "bias": (L, E)},
            "fc": {"kernel": (L, E, inner), "bias": (L, inner)},
            "proj": {"kernel": (L, inner, E), "bias": (L, E)},
        },
        "ln_f": norm(),
    }


def param_shape_tree(cfg: ModelConfig) -> dict:
    """Nested dicts (the params' structure) of shape tuples; every param is fp32."""
    if isinstance(cfg, LlamaConfig):
        return _llama(cfg)
    if isinstance(cfg, GPT2Config):
        return _gpt2(cfg)
    raise ConfigError(f"expected LlamaConfig or GPT2Config, found {type(cfg).__name__}")
