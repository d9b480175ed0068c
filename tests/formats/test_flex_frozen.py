"""FlexCheckpoint params the optimizer never held (frozen in Paddle: ERNIE 4.5's correction bias)
get zero moments (`reader.zero_state_for_frozen`), in the slot's dtype and without memory for
the declared shape (a shape is the file's word). The real case: tests/real/test_real_paddle_ernie.py."""

from __future__ import annotations

import numpy as np

from hybridckpt import lazy
from hybridckpt.formats.flex_checkpoint.reader import zero_state_for_frozen

HUGE = (1 << 21, 1 << 21)  # 16 TiB of fp32 declared


def test_frozen_params_get_zero_moments_lazily():
    trained = lazy.ArrayTensor(np.ones((3, 2), np.float32))
    frozen = lazy.ArrayTensor(np.broadcast_to(np.ones((), np.float16), HUGE))
    tensors = {"w": trained, "bias": frozen}
    slots = {s: {"w": lazy.ArrayTensor(np.full((3, 2), 0.5, np.float32))} for s in ("exp_avg", "exp_avg_sq")}
    notes: list[str] = []
    zero_state_for_frozen(tensors, slots, notes)
    for d in slots.values():
        z = d["bias"]
        assert z.shape == HUGE and np.dtype(z.dtype) == np.float32  # the slot's dtype, not the param's
        box = z.read_box(((5, 7), (HUGE[1] - 3, HUGE[1])))
        assert box.shape == (2, 3) and not box.any()
        assert d["w"] is not z and d["w"].read_box(((0, 3), (0, 2))).tolist() == [[0.5, 0.5]] * 3
    assert len(notes) == 1 and "'bias'" in notes[0] and "zero moments" in notes[0]


def test_no_optimizer_state_no_moments():
    tensors = {"w": lazy.ArrayTensor(np.ones((2,), np.float32))}
    slots: dict = {}
    notes: list[str] = []
    zero_state_for_frozen(tensors, slots, notes)
    assert slots == {} and notes == []
