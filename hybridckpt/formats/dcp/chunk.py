"""DCP's own lazy tensor: a chunk saved with `torch.save` inside a `.distcp` file (the global
tensor tiled from such chunks at their offsets is `lazy.tiled`).

A `.distcp` chunk is a complete `torch.save` zip archive of the local block (shape = chunk
sizes) at bytes `[offset, offset + length)` of the file (pytorch/pytorch:
torch/distributed/checkpoint/filesystem.py); a global tensor is the blocks at the offsets the
metadata gives, which tile it exactly (checked by the caller, `containers.dcp_metadata.check_tiling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.lazy import Deferred, LazyTensor


@dataclass(frozen=True, eq=False)
class TorchSaveChunk(Deferred):
    """A block saved with `torch.save` at `[offset, offset + length)` of `path`.

    The archive's zip directory and pickle are parsed on the first read (not at open time), then
    only the bytes of each box are read. `shape`, `dtype` as the metadata says; the archive
    must agree."""

    path: str
    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: np.dtype
    fqn: str = ""
    _cache: dict = field(default_factory=dict, repr=False)  # the parsed archive, once

    def tensor(self) -> LazyTensor:
        t = self._cache.get("t")
        if t is None:  # two threads may both parse it: harmless, same result
            t = torch_save.load(self.path, base_offset=self.offset, length=self.length)
            what = f"{self.path}@{self.offset}+{self.length} ('{self.fqn}')"
            if not isinstance(t, LazyTensor):
                raise FormatError(f"{what}: chunk holds {type(t).__name__}, not a tensor")
            if tuple(t.shape) != self.shape or np.dtype(t.dtype) != np.dtype(self.dtype):
                raise FormatError(
                    f"{what}: chunk is {t.dtype} {t.shape}, the metadata says "
                    f"{self.dtype} {self.shape}"
                )
            self._cache["t"] = t
        return t
