"""AdamW (torch.optim.Adam/AdamW, DeepSpeed FusedAdam, Megatron's distributed Adam, Paddle's
AdamW): two moments shaped like their parameter and a step counter.

torch `state[p]`: `exp_avg` (first moment), `exp_avg_sq` (second moment), `step` (pytorch/pytorch:
torch/optim/adam.py). optax (`optax.adamw`, google-deepmind/optax: optax/_src/transform.py
`ScaleByAdamState(count, mu, nu)`) keeps them as `state[0].mu`, `state[0].nu` (trees shaped like
the params) and `state[0].count` (int32 scalar): the same numbers under other names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.errors import CheckpointError
from hybridckpt.optim.base import Optimizer, Relation, Slot


def _adamw_state(params: Any) -> Any:
    import optax

    return optax.adamw(1e-3).init(params)


def _number(hyper: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = hyper.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise CheckpointError(f"optimizer hyper-parameters: {key!r} is {v!r}; a number is needed to rebuild AdamW")
    return float(v)


def build_adamw(hyper: Mapping[str, Any], mask: Any = None) -> Any:
    """`optax.adamw` with torch's AdamW hyper-parameters: `lr`, `betas`, `eps`, `weight_decay`
    (decoupled: torch's AdamW and optax's adamw both subtract `lr * wd * p` from the param before
    the Adam step), `mask` where only some params decay. torch's Adam with a non-zero, coupled
    weight decay (`decoupled_weight_decay: False`: the decay added to the gradient) is another
    optimizer and is refused. eps_root 0, bias correction as torch's."""
    import optax

    betas = hyper.get("betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise CheckpointError(f"optimizer hyper-parameters: 'betas' is {betas!r}; two numbers are needed to rebuild AdamW")
    wd = _number(hyper, "weight_decay", 0.0)
    if wd and hyper.get("decoupled_weight_decay") is False:
        raise CheckpointError(
            "optimizer hyper-parameters: torch Adam with coupled weight decay (decoupled_weight_decay False, "
            f"weight_decay {wd}) is not optax.adamw; rebuild it by hand"
        )
    return optax.adamw(
        _number(hyper, "lr"), b1=float(betas[0]), b2=float(betas[1]), eps=_number(hyper, "eps", 1e-8),
        weight_decay=wd, mask=mask,
    )


OPTIMIZER = Optimizer(
    name="adamw",
    slots=(
        Slot("exp_avg", "mu", Relation.PARAM),
        Slot("exp_avg_sq", "nu", Relation.PARAM),
    ),
    state_paths={"exp_avg": (0, "mu"), "exp_avg_sq": (0, "nu"), "step": (0, "count")},
    make_state=_adamw_state,
    build=build_adamw,
    layout=(("count", "mu", "nu"), (), ()),  # optax.adamw: scale_by_adam, add_decayed_weights, the learning rate
)
