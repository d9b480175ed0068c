"""Mistral's native Mixtral (mistralai/mistral-inference: `params.json` with `moe` plus
`consolidated.safetensors`): Mistral's params.json (models/mistral/dialects/meta.py) with
`moe` (mistral_inference/moe.py `MoeArgs`: `num_experts`, `num_experts_per_tok`), an HF
MixtralConfig dict; the names map by `meta.rules`. Its routing (top-k of the logits, then a
softmax over those k) equals HF Mixtral's softmax, top-k, renormalise. mistral-inference splits
no expert across ranks (it has pipeline ranks only), so Mixtral comes as one file. Refused:
`moe` keys other than those two."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.models.errors import UnknownModelError

PARAMS = ("hidden_dim", "head_dim", "moe")  # params.json keys that mark the family
MOE_ARGS = ("num_experts", "num_experts_per_tok")  # mistral_inference/moe.py MoeArgs


def config(params: Mapping[str, Any], vocab_size: int | None, source: str):
    """The MixtralConfig of a Mistral params.json with `moe`."""
    from hybridckpt.models.api import config_from_hf
    from hybridckpt.models.mistral.dialects.meta import hf_config

    hf = hf_config(params, source)
    moe = params["moe"]
    if not isinstance(moe, dict) or set(moe) != set(MOE_ARGS):
        found = sorted(moe) if isinstance(moe, dict) else moe
        raise UnknownModelError(
            f"{source}: 'moe' {found!r}: only Mixtral's MoeArgs {list(MOE_ARGS)} are implemented"
        )
    hf |= {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": moe["num_experts"],
        "num_experts_per_tok": moe["num_experts_per_tok"],
    }
    return config_from_hf(hf, source=source)
