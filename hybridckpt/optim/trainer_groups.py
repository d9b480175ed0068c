"""The HF Trainer's two parameter groups: the parameters weight decay applies to, and the rest.

transformers 5.24 (src/transformers/trainer.py `Trainer.create_optimizer`,
`get_decay_parameter_names`; trainer_pt_utils.py `get_parameter_names`): group 0 holds the
parameters whose lower-cased full name matches none of `FORBIDDEN` and that do not belong to an
`nn.LayerNorm` module, group 1 the others, both in `model.named_parameters()` order and both
present even when one is empty (group 0 with `weight_decay = args.weight_decay`, group 1 with 0.0).
Only parameters that require grad are in either. A pattern is searched in the full dotted name
(`model.layers.0.input_layernorm.weight`), which is what the Trainer's recursion over child
modules amounts to for these patterns.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

FORBIDDEN: tuple[str, ...] = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
_PATTERNS = tuple(re.compile(p) for p in FORBIDDEN)


def decays(name: str, layernorm_params: Collection[str] = ()) -> bool:
    """Whether the Trainer puts parameter `name` (full HF name) in its weight-decay group:
    no pattern of `FORBIDDEN` in its lower-cased name and not a parameter of an `nn.LayerNorm`
    (`layernorm_params`: the names of those, e.g. GPT-2's `transformer.h.0.ln_1.weight`)."""
    return name not in layernorm_params and not any(p.search(name.lower()) for p in _PATTERNS)


def trainer_groups(names: Sequence[str], layernorm_params: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """(decay group, no-decay group): `names` (trainable params, `named_parameters()` order) split
    by `decays`, each in the order given."""
    decay = [n for n in names if decays(n, layernorm_params)]
    chosen = set(decay)
    return decay, [n for n in names if n not in chosen]
