"""Quantized Hugging Face releases, dequantized on import (lazily, box by box; no torch).

`config.json` says how the weights are stored (`quantization_config.quant_method`):
- `fp8` (DeepSeek V3 / R1 / V3.2, Kimi K2, transformers' `FineGrainedFP8Config`): a Linear's
  `X.weight` is float8_e4m3fn `[out, in]` (fused experts: `[E, out, in]`, their scale named
  `X_scale_inv`) and `X.weight_scale_inv` float32 `[ceil(out / bo), ceil(in / bi)]` multiplies
  each `[bo, bi] = weight_block_size` block, the grid anchored at 0 (edge blocks partial); no
  `weight_block_size`: one scale for the whole tensor (`[1, 1]` or 0-d). Norms, embeddings, the
  router and the head are stored unquantized. `activation_scale` / `input_scale` (static
  activation quantization) describe the quantized runtime only: dropped, with a note.
  transformers 5.24's own CPU dequantization infers a block as `shape // grid`, wrong for partial
  edge blocks; DeepSeek's `weight_dequant` (inference/kernel.py) is the reference followed here.
- `mxfp4` (GPT-OSS, as OpenAI's converter writes it): an expert weight `X` is `X_blocks` uint8
  `[E, out, in / 32, 16]` + `X_scales` uint8 `[E, out, in / 32]` (`lazy.quantized.Mxfp4`); after
  dequantizing, transformers holds it as `X` `[E, in, out]` (`mlp.experts.gate_up_proj`
  `[E, hidden, 2 * intermediate]`, `down_proj` `[E, intermediate, hidden]`): the name and layout
  given here, the ones an export writes.

A dequantized tensor's values are float32 (exact for MXFP4; for FP8 the one float32 rounding of
`q * scale` that DeepSeek's kernel makes). Having no stored float dtype of its own, it is read as
`DEFAULT_DTYPE` (bfloat16, the dtype the releases keep their unquantized weights in and declare in
`torch_dtype`; every MXFP4 value is exact in it) over those float32 values (`lazy.dtypes.Dequantized`):
what an import stores and an export writes unless `--dtype` says otherwise, `--dtype float32`
casting from the exact values. Every tensor stored unquantized keeps its own dtype (GPT-OSS's
fp32 RMSNorm weights stay fp32). The config read on is the source's without `quantization_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridckpt import lazy
from hybridckpt.errors import FormatError, short_repr
from hybridckpt.lazy import LazyTensor
from hybridckpt.lazy.dtypes import Dequantized, np_dtype
from hybridckpt.lazy.quantized import BlockScaled, Mxfp4

DEFAULT_DTYPE = "bfloat16"  # a dequantized tensor's stored dtype: what an import or export writes unless --dtype says
METHODS = ("fp8", "mxfp4")
FP8_SCALE = "_scale_inv"
ACTIVATION_SCALES = (".activation_scale", ".input_scale")
MAX_BLOCK = 1 << 20


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint's weights are stored: `method` ("fp8", "mxfp4"), the FP8 `block`
    `(out, in)` or None (one scale per tensor), and the `quantization_config` as written."""

    method: str
    block: tuple[int, int] | None = None
    config: Mapping[str, Any] = field(default_factory=dict)

    def describe(self, dequantized: int) -> dict[str, Any]:
        """What `inspect` and the import's trainer state record."""
        out: dict[str, Any] = {"quant_method": self.method, "dequantized_tensors": dequantized,
                               "stored_as": DEFAULT_DTYPE + " unless --dtype"}
        if self.block is not None:
            out["weight_block_size"] = list(self.block)
        return out


def quantization(hf_config: Mapping[str, Any] | None, where: str) -> Quantization | None:
    """The quantization an HF `config.json` announces, or None; FormatError for one not read."""
    qc = (hf_config or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise FormatError(f"{where}: quantization_config: expected an object, found {short_repr(qc)}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise FormatError(
            f"{where}: quantized weights ({short_repr(method)}) are not supported; supported: "
            f"{', '.join(METHODS)} (dequantized on import)"
        )
    block = None
    if method == "fp8":
        if qc.get("fmt", "e4m3") not in ("e4m3", None):
            raise FormatError(f"{where}: quantization_config.fmt {short_repr(qc.get('fmt'))}: expected 'e4m3'")
        raw = qc.get("weight_block_size")
        if raw is not None:
            ok = isinstance(raw, list) and len(raw) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in raw)
            if not ok:
                raise FormatError(f"{where}: quantization_config.weight_block_size: expected two block sizes "
                                  f"[out, in] in 1..{MAX_BLOCK}, found {short_repr(raw)}")
            block = (raw[0], raw[1])
    return Quantization(method, block, dict(qc))


def without_quantization(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the dequantized model: `quantization_config` removed."""
    return {k: v for k, v in hf_config.items() if k != "quantization_config"}


def dequantize(tensors: Mapping[str, LazyTensor], q: Quantization, where: str
               ) -> tuple[dict[str, LazyTensor], int, tuple[str, ...]]:
    """(the tensors with every quantized weight replaced by its dequantized view (`Dequantized`:
    `DEFAULT_DTYPE` over the float32 values) under the name transformers gives it after
    dequantizing, how many were, notes)."""
    if q.method == "fp8":
        return _fp8(tensors, q.block, where)
    return _mxfp4(tensors, where)


def _fp8(tensors: Mapping[str, LazyTensor], block: tuple[int, int] | None, where: str
         ) -> tuple[dict[str, LazyTensor], int, tuple[str, ...]]:
    out = dict(tensors)
    done = 0
    for sname in [n for n in tensors if n.endswith(FP8_SCALE)]:
        wname = sname[: -len(FP8_SCALE)]
        if wname not in tensors:
            raise FormatError(f"{where}: {short_repr(sname)} scales {short_repr(wname)}, which is not in the checkpoint")
        w, s = out.pop(wname), out.pop(sname)
        if np.dtype(w.dtype).name not in ("float8_e4m3fn", "float8_e5m2"):
            raise FormatError(f"{where}: {short_repr(wname)} has scales {short_repr(sname)} but is "
                              f"{np.dtype(w.dtype)}, not float8_e4m3fn")
        if w.ndim < 2:
            raise FormatError(f"{where}: {short_repr(wname)}: a block-quantized weight needs 2+ dims, found {w.shape}")
        b = block or (w.shape[-2], w.shape[-1])
        if s.ndim == 0 and block is None:
            s = lazy.reshape(s, (1,) * w.ndim)
        try:
            out[wname] = Dequantized(BlockScaled(w, s, b), np_dtype(DEFAULT_DTYPE))
        except FormatError as e:
            raise FormatError(f"{where}: {short_repr(sname)}: {e}") from None
        done += 1
    dropped = sorted(n for n in out if n.endswith(ACTIVATION_SCALES))
    for n in dropped:
        del out[n]
    stray = sorted(n for n, t in out.items() if np.dtype(t.dtype).name.startswith("float8"))
    if stray:
        raise FormatError(f"{where}: fp8 tensors without a {FP8_SCALE} scale: {stray[:5]}")
    notes = (f"fp8: {len(dropped)} activation scales of the quantized runtime dropped",) if dropped else ()
    return out, done, notes


def _mxfp4(tensors: Mapping[str, LazyTensor], where: str) -> tuple[dict[str, LazyTensor], int, tuple[str, ...]]:
    out = dict(tensors)
    done = 0
    for bname in [n for n in tensors if n.endswith("_blocks")]:
        base = bname[: -len("_blocks")]
        sname = base + "_scales"
        if sname not in tensors:
            raise FormatError(f"{where}: {short_repr(bname)} has no {short_repr(sname)}")
        if base in tensors:
            raise FormatError(f"{where}: both {short_repr(base)} and its MXFP4 blocks {short_repr(bname)}")
        blocks, scales = out.pop(bname), out.pop(sname)
        try:
            deq = Mxfp4(blocks, scales)
        except FormatError as e:
            raise FormatError(f"{where}: {short_repr(bname)}: {e}") from None
        if deq.ndim < 2:  # stored [..., out, in]: the two last axes are swapped below
            raise FormatError(f"{where}: {short_repr(bname)}: MXFP4 blocks {tuple(blocks.shape)} and scales "
                              f"{tuple(scales.shape)}: expected blocks [..., rows, G, 16] and scales [..., rows, G]")
        axes = list(range(deq.ndim))
        axes[-2], axes[-1] = axes[-1], axes[-2]
        out[base] = Dequantized(lazy.transpose(deq, axes), np_dtype(DEFAULT_DTYPE))
        done += 1
    stray = sorted(n for n in out if n.endswith("_scales"))
    if stray:
        raise FormatError(f"{where}: MXFP4 scales without blocks: {stray[:5]}")
    return out, done, ()
