"""Paddle optimizer state as slots, and the step its AdamW's beta pow accumulators record.

Paddle keeps per-parameter state as accumulators named `<param.name>[_fp32_master_0]_<acc>_N`
in `.pdopt` files, `<name>/<acc>_0` in unified checkpoints (paddle/optimizer/adamw.py
`_moment1_acc_str`, `_moment2_acc_str`, `_beta1_pow_acc_str`, `_beta2_pow_acc_str`;
momentum.py `_velocity_acc_str`). `SLOT_OF_ACCUMULATOR` maps each per-parameter accumulator to
the slot torch gives the same numbers (`hybridckpt.optim`); `BETA_POWS` are AdamW's `[1]`
accumulators beta ** (step + 1), each with the moment it goes with and which beta it powers.

The optimizer step: Paddle's AdamW starts a beta pow at beta and multiplies it by fp32(beta)
after each step, so the exponent recovers the step (`step_from_beta_pow`); the betas come from
`training_args.bin` when readable, else Paddle's defaults 0.9 / 0.999 (and a note says so).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from hybridckpt.containers.pickle import paddle_save
from hybridckpt.errors import HybridCkptError
from hybridckpt.lazy import LazyTensor, scalar_value

DEFAULT_BETAS = (0.9, 0.999)  # paddle.optimizer.AdamW / PaddleNLP TrainingArguments defaults

# Paddle's per-parameter optimizer accumulators (paddle/optimizer/adamw.py `_moment1_acc_str`,
# `_moment2_acc_str`; momentum.py `_velocity_acc_str`) -> the slot torch gives the same state
SLOT_OF_ACCUMULATOR = {
    "moment1": "exp_avg",
    "moment2": "exp_avg_sq",
    "velocity": "momentum_buffer",
}
# the Adam moment each `[1]` beta pow accumulator goes with, and which beta it powers (0 or 1)
BETA_POWS = {"beta1_pow_acc": ("exp_avg", 0), "beta2_pow_acc": ("exp_avg_sq", 1)}
ACCUMULATOR_RE = re.compile(
    r"^(?:slice@)?(?P<p>.+?)(?:_fp32_master_\d+)?_(?P<acc>"
    + "|".join([*SLOT_OF_ACCUMULATOR, *BETA_POWS])
    + r")_\d+$"
)


def step_from_beta_pow(value: float, beta: float) -> int | None:
    """Optimizer steps taken from a Paddle `beta_pow_acc`.

    Paddle's AdamW starts the accumulator at beta and multiplies it by fp32(beta) after each
    step (phi adamw kernel: `beta1_pow_out = beta1_pow * beta1` in fp32), so after `step` steps
    it holds beta ** (step + 1); the log in base fp32(beta) recovers the exponent to within
    0.01 while the value is a normal fp32 (0.9: ~830 steps, 0.999: ~87000). None when it has
    underflowed or is not a power of `beta`."""
    if not (np.finfo(np.float32).tiny <= value <= 1.0) or not (0.0 < beta < 1.0):
        return None
    k = math.log(value) / math.log(float(np.float32(beta)))
    n = round(k)
    if abs(k - n) > 0.1:
        return None
    return max(n - 1, 0)


def beta_pow(beta: float, step: int) -> np.ndarray:
    """The `[1]` fp32 accumulator Paddle holds after `step` steps: fp32(beta) multiplied in
    fp32 `step + 1` times (sequential cumprod reproduces the kernel's rounding)."""
    return np.cumprod(np.full(step + 1, beta, dtype=np.float32), dtype=np.float32)[-1:].copy()


def optimizer_step(
    beta1_pows: Sequence[float], beta2_pows: Sequence[float], betas, *, betas_read: bool = True
) -> int | None:
    """The step all beta pow accumulators agree on (beta1 first: more precise), else None.

    betas_read: whether `betas` are the run's own (from training_args.bin). When they are
    Paddle's defaults assumed, beta1's and beta2's accumulators must both give the same step: a
    wrong beta2 alone can look like a whole number of steps (a real Paddle 3.3.1 save with betas
    0.8/0.95 after 3 steps holds 0.95 ** 4, which reads as 204 steps of 0.999)."""
    found = []
    for values, beta in ((beta1_pows, betas[0]), (beta2_pows, betas[1])):
        steps = {step_from_beta_pow(float(v), beta) for v in values}
        steps.discard(None)
        found.append(steps.pop() if len(steps) == 1 else None)
        if betas_read and found[-1] is not None:
            return found[-1]
    if not betas_read and found[0] is not None and found[0] == found[1]:
        return found[0]
    return None


def betas_of(folder: str) -> tuple[tuple[float, float], str | None]:
    """(beta1, beta2) from training_args.bin (a pickled PaddleNLP TrainingArguments, read as a
    stub), else the defaults and a note."""
    path = os.path.join(folder, "training_args.bin")
    if os.path.isfile(path):
        try:
            args = paddle_save.safe_load(path)
            b1, b2 = getattr(args, "adam_beta1", None), getattr(args, "adam_beta2", None)
            if isinstance(b1, float) and isinstance(b2, float):
                return (b1, b2), None
        except HybridCkptError:
            pass
    return (
        DEFAULT_BETAS,
        f"optimizer step derived assuming betas {DEFAULT_BETAS} (Paddle's defaults)",
    )


def adam_step(folder: str, beta_pows: Mapping[str, Sequence[float]], notes: list[str]):
    """(optimizer step, hyper) from the beta pow accumulators found (`BETA_POWS` name -> values)
    and the betas of `folder` (a note in `notes` when Paddle's defaults were assumed); (None, {})
    when there are none (an optimizer without them)."""
    if not any(beta_pows.values()):
        return None, {}
    betas, note = betas_of(folder)
    step = optimizer_step(
        beta_pows["beta1_pow_acc"], beta_pows["beta2_pow_acc"], betas, betas_read=note is None
    )
    if step is not None and note:
        notes.append(note)
    elif step is None:
        notes.append(
            f"optimizer step unknown: the beta pow accumulators are not powers of the betas {betas}"
            + (" (Paddle's defaults; training_args.bin gives none)" if note else "")
        )
    return step, {"betas": list(betas)}


def scalar(t: LazyTensor, where: str = "paddle optimizer", what: str = "scalar") -> float:
    """The value of a one-element (`[1]`) tensor, as a Python float; its size checked before it
    is read (`lazy.scalar_value`)."""
    return scalar_value(t, where, what)
