"""AdamW (torch.optim.Adam/AdamW, DeepSpeed FusedAdam, Megatron's distributed Adam, Paddle's
AdamW): two moments shaped like their parameter and a step counter.

torch `state[p]`: `exp_avg` (first moment), `exp_avg_sq` (second moment), `step` (pytorch/pytorch:
torch/optim/adam.py). optax (`optax.adamw`, google-deepmind/optax: optax/_src/transform.py
`ScaleByAdamState(count, mu, nu)`) keeps them as `state[0].mu`, `state[0].nu` (trees shaped like
the params) and `state[0].count` (int32 scalar): the same numbers under other names.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.optim.base import Optimizer, Relation, Slot


def _adamw_state(params: Any) -> Any:
    import optax

    return optax.adamw(1e-3).init(params)


OPTIMIZER = Optimizer(
    name="adamw",
    slots=(
        Slot("exp_avg", "mu", Relation.PARAM),
        Slot("exp_avg_sq", "nu", Relation.PARAM),
    ),
    state_paths={"exp_avg": (0, "mu"), "exp_avg_sq": (0, "nu"), "step": (0, "count")},
    make_state=_adamw_state,
)
