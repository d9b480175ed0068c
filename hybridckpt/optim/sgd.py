"""SGD with momentum (torch.optim.SGD, `momentum > 0`): one buffer shaped like its parameter.

torch `state[p]`: `momentum_buffer` (pytorch/pytorch: torch/optim/sgd.py, `buf = momentum * buf
+ grad`, with dampening 0); no step counter. optax (`optax.sgd(lr, momentum)`, a chain of
`trace(decay=momentum)` and the learning rate: google-deepmind/optax optax/_src/alias.py,
transform.py `TraceState(trace)`) keeps it as `state[0].trace`: the same numbers, and the same
update (`trace = g + momentum * trace`, `p -= lr * trace`) for nesterov=False, dampening=0.
"""

from __future__ import annotations

from typing import Any

from hybridckpt.optim.base import Optimizer, Relation, Slot


def _sgd_state(params: Any) -> Any:
    import optax

    return optax.sgd(1e-3, momentum=0.9).init(params)


OPTIMIZER = Optimizer(
    name="sgd",
    slots=(Slot("momentum_buffer", "trace", Relation.PARAM),),
    state_paths={"momentum_buffer": (0, "trace")},
    make_state=_sgd_state,
    step_name="",
)
