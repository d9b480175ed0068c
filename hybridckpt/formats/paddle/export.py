"""Export into Paddle's unified layouts: `hybridckpt export --to paddlenlp-unified|paddleformers-unified`.

The export job (`jobs/export.py`) hands over what it would write as Hugging Face files: the
model's tensors under HF names (`[out, in]`, as our checkpoints hold them: fp32, the master
weights of a 16-bit run), the optimizer slots under the same names, the step. `write_export`
writes them with `unified.write_unified` in the chosen flavour (`LAYOUTS`):
- `paddlenlp-unified`: PaddleNLP's structured names and `[in, out]` Linear weights (the family
  must be one `rules.FAMILIES` knows), optimizer state in the weights' layout;
- `paddleformers-unified`: PaddleFormers 1.x's HF names and `[out, in]` weights, the optimizer
  state and master weights of Linear weights in Paddle's `[in, out]` (`paddleformers.py`).
Params cast to a 16-bit `dtype` with the optimizer keep their fp32 values as `master_weights-*`
(what Paddle's AMP O2 saves); AdamW's beta pows are written from the step and the betas
(the source's, `adam_betas` in its trainer state, else Paddle's defaults). The folder appears
complete or not at all (`io.destination.Destination`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hybridckpt.errors import ConfigError
from hybridckpt.formats.paddle import paddleformers, unified
from hybridckpt.io.destination import Destination
from hybridckpt.lazy import LazyTensor

LAYOUTS = {
    "paddlenlp-unified": paddleformers.PADDLENLP,
    "paddleformers-unified": paddleformers.PADDLEFORMERS,
}
SIXTEEN_BIT = (np.dtype(np.float16), unified.BF16)


def write_export(
    out: str,
    params: Mapping[str, LazyTensor],
    cfg: Any,
    *,
    layout: str,
    slots: Mapping[str, Mapping[str, LazyTensor]] | None = None,
    step: int | None = None,
    dtype: np.dtype | None = None,
    overwrite: bool = False,
    sources: tuple[str, ...] = (),
    betas: tuple[float, float] | list[float] | None = None,
) -> list[str]:
    """Write HF-named `params` (and `slots`, `step`) of model config `cfg` at `out` in `layout`
    (a key of `LAYOUTS`), never at or around one of `sources`; returns the file names written.
    `betas`: AdamW's, for the beta pows (the source's `adam_betas` when it recorded them; else
    Paddle's defaults)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"export: layout {layout!r}; expected one of {sorted(LAYOUTS)}")
    if cfg is None:
        raise ConfigError(
            f"export --to {layout}: needs a model config (the source has none; pass --config)"
        )
    first = np.dtype(next(iter(params.values())).dtype)
    written = np.dtype(dtype) if dtype is not None else first
    master = None
    if slots and written in SIXTEEN_BIT and first == np.float32:
        master = dict(params)  # AMP O2: fp32 master weights beside the 16-bit params
    dest = Destination(out, overwrite=overwrite, sources=sources)
    with dest as tmp:
        files = unified.write_unified(
            tmp,
            params,
            config=cfg,
            slots=slots or None,
            master=master,
            step=step,
            betas=tuple(betas) if betas else unified.DEFAULT_BETAS,
            dtype=dtype,
            flavour=LAYOUTS[layout],
        )
        dest.commit()
    return files
