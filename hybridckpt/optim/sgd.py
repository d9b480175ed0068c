"""SGD with momentum (torch.optim.SGD, `momentum > 0`): one buffer shaped like its parameter.

torch `state[p]`: `momentum_buffer` (pytorch/pytorch: torch/optim/sgd.py, `buf = momentum * buf
+ grad`, with dampening 0); no step counter. optax (`optax.sgd(lr, momentum)`, a chain of
`trace(decay=momentum)` and the learning rate: google-deepmind/optax optax/_src/alias.py,
transform.py `TraceState(trace)`) keeps it as `state[0].trace`: the same numbers, and the same
update (`trace = g + momentum * trace`, `p -= lr * trace`) for nesterov=False, dampening=0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridckpt.errors import CheckpointError
from hybridckpt.optim.base import Optimizer, Relation, Slot


def _sgd_state(params: Any) -> Any:
    import optax

    return optax.sgd(1e-3, momentum=0.9).init(params)


def build_sgd(hyper: Mapping[str, Any], mask: Any = None) -> Any:
    """`optax.sgd(lr, momentum, nesterov)` from torch's SGD param group; a weight decay or a
    dampening (torch adds them to the gradient) is refused: optax's sgd has neither."""
    import optax

    lr, momentum = hyper.get("lr"), hyper.get("momentum", 0.0)
    if not isinstance(lr, (int, float)) or not isinstance(momentum, (int, float)):
        raise CheckpointError(f"optimizer hyper-parameters: lr {lr!r}, momentum {momentum!r}: numbers are needed to rebuild SGD")
    if hyper.get("weight_decay") or hyper.get("dampening"):
        raise CheckpointError("optimizer hyper-parameters: SGD with weight_decay or dampening is not optax.sgd; rebuild it by hand")
    return optax.sgd(float(lr), momentum=float(momentum), nesterov=bool(hyper.get("nesterov", False)))


OPTIMIZER = Optimizer(
    name="sgd",
    slots=(Slot("momentum_buffer", "trace", Relation.PARAM),),
    state_paths={"momentum_buffer": (0, "trace")},
    make_state=_sgd_state,
    step_name="",
    build=build_sgd,
    layout=(("trace",), ()),  # optax.sgd with momentum: trace, the learning rate
)
