"""The codec of the arrays a streaming import writes: the zarr v2 compressor of each array.

`StreamOptions.compression` (`hybridckpt import --compression`) is recorded in every array's
`.zarray` (Orbax's `array_metadatas/` keep only shapes), where any zarr reader, plain `orbax.checkpoint`
included, finds it:
- "none" (the default): each chunk is its raw C-order little-endian bytes;
- "zstd": Orbax's own default for zarr v2 (level 1,
  google/orbax:checkpoint/orbax/checkpoint/_src/serialization/tensorstore_utils.py
  `_build_zarr2_metadata`); "zstd:N" another level (1-22).

Why "none" (docs/benchmarks.md "The Orbax write and read paths", `benchmarks/orbax_speed.py`): on trained-like weights (normal,
per-row scales) zstd level 1 saves about 21% of bf16 bytes and 7% of fp32 bytes (higher levels
barely more) while its encoding takes most of an import's write time on 2 cores and its decoding
most of an export's read time; a converter's output is read back soon and whole, so the disk's
speed wins. Uncompressed C-order chunks are also what lets an export copy their byte ranges file
to file (`containers.orbax.reader`, `containers.orbax.chunk_index`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridckpt.errors import ConfigError

COMPRESSION = "none"  # default codec of a streaming save
COMPRESSION_CHOICES = "none, zstd (Orbax's default, level 1) or zstd:LEVEL (1-22)"


def parse_compression(text: str) -> tuple[str, int | None]:
    """("none", None) or ("zstd", level) of a `--compression` value; a ConfigError otherwise."""
    name, _, level = str(text).strip().lower().partition(":")
    if name == "none" and not level:
        return "none", None
    if name == "zstd":
        if not level:
            return "zstd", 1
        if level.isdigit() and 1 <= int(level) <= 22:
            return "zstd", int(level)
    raise ConfigError(f"--compression {text!r}: expected {COMPRESSION_CHOICES}")


def apply_codec(spec: Any, compression: str) -> None:
    """Set the zarr v2 compressor of an Orbax write spec (`ts_utils.ArrayWriteSpec`, from
    `stream_orbax`: its JSON and its in-memory ArrayMetadata) to `compression`; a zarr v3 spec
    keeps Orbax's codecs."""
    algo, level = parse_compression(compression)
    tspec = spec.json.get("base", spec.json) if spec.json.get("driver") == "cast" else spec.json
    if tspec.get("driver") != "zarr":  # (zarr v2: Orbax's `ZARR_VER2`)
        return
    tspec["metadata"]["compressor"] = None if algo == "none" else {"id": "zstd", "level": level}
    spec._metadata = dataclasses.replace(  # noqa: SLF001 - the metadata Orbax records for it
        spec.metadata, compression_algorithm=algo, compression_level=level
    )
