"""Where each stored chunk of an Orbax item lies in its files: the OCDBT index, read once.

An Orbax item (`DIR/<step>/<item>/`) is one OCDBT database (google/tensorstore:
tensorstore/kvstore/ocdbt): `manifest.ocdbt` points at the root B+tree node of the latest
version; leaf nodes map each key (`<array>/.zarray`, `<array>/<i>.<j>...`, zarr v2 chunk keys
with "." separators) to its value, either inline in the node (values up to
`max_inline_value_bytes`, 1024 for Orbax) or by reference `value:<base>:<file>:<offset>:<length>`:
the value is bytes `[offset, offset + length)` of the data file `<item>/<base><file>`
(`<base>` is `ocdbt.process_<i>/` for the per-process databases Orbax merges, empty otherwise).
Values are stored as written (the manifest's `compression` applies to B-tree nodes only), so
an uncompressed zarr chunk is its C-order bytes at that range.

`read_index(item_dir)` walks the index with `tensorstore.ocdbt.dump` (nodes only, no values
read): `ItemIndex.locations` maps each value stored by reference to its `ChunkLocation`,
`ItemIndex.zarrays` each array's `.zarray` metadata (small, so inline in a node) as parsed JSON,
`ItemIndex.inline` the other inline values (chunks of at most 1024 bytes) as bytes.
Only tensorstore is imported (no JAX, no Orbax): an export of our store runs in tens of MiB.

An item saved without OCDBT (no `manifest.ocdbt`; a raw `hybridckpt import`, `containers.orbax.chunk_files`)
keeps each array in its own folder `<item>/<array>/`: its `.zarray` and one file per chunk. The
same `ItemIndex` is then read by listing those folders: each chunk file is a location at offset
0 of its whole length; nothing is inline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from hybridckpt.errors import CheckpointError, FormatError, short_repr
from hybridckpt.io import json_text
from hybridckpt.io.paths import inside
from hybridckpt.io.regular_file import NotRegular, open_regular_file

OCDBT_MANIFEST = "manifest.ocdbt"  # at the root of an item saved with OCDBT (Orbax's `format_utils`)


class UnsafeItem(CheckpointError):
    """An item whose index names a data file outside it, or that holds a special file: never
    read, whichever reader (ours or TensorStore) is asked."""


class ChunkLocation(NamedTuple):
    """A value stored by reference: `length` bytes at byte `offset` of the file `path`."""

    path: str
    offset: int
    length: int


def parse_location(item_dir: str, ref: str) -> ChunkLocation:
    """`value:<base>:<file>:<offset>:<length>` (as `ocdbt.dump` writes it) -> ChunkLocation."""
    head, offset, length = ref.rsplit(":", 2)
    kind, base, rel = head.split(":", 2)
    if kind != "value" or not offset.isdigit() or not length.isdigit() or len(offset) > 20 or len(length) > 20:
        raise CheckpointError(f"{item_dir}: OCDBT index: cannot read the value reference {short_repr(ref)}")
    try:
        path = inside(item_dir, base + rel, f"{item_dir}: OCDBT index", "data file")
    except FormatError as e:
        raise UnsafeItem(str(e)) from None
    return ChunkLocation(path, int(offset), int(length))


@dataclass(frozen=True)
class ItemIndex:
    """What the OCDBT index of one item says: values stored by reference, by key, and the
    `.zarray` metadata of each array stored inline, by array name."""

    locations: dict[str, ChunkLocation]
    zarrays: dict[str, dict]
    inline: dict[str, bytes]


def chunk_locations(item_dir: str, context=None) -> dict[str, ChunkLocation]:
    """Every value of the item's OCDBT database stored by reference, by key (see the module doc)."""
    return read_index(item_dir, context).locations


def read_index(item_dir: str, context=None) -> ItemIndex:
    """The item's `ItemIndex` (see the module doc); a CheckpointError when its index is unreadable
    (an index naming a data file outside the item: `UnsafeItem`)."""
    if not os.path.isfile(os.path.join(item_dir, OCDBT_MANIFEST)):
        return _list_folders(item_dir)
    import tensorstore as ts

    try:
        return _walk(ts, item_dir, context)
    except ValueError as e:
        raise CheckpointError(f"{item_dir}: cannot read the OCDBT index: {str(e)[:200]}") from e


def _walk(ts, item_dir: str, context) -> ItemIndex:
    from hybridckpt.io.remote import ts_kvstore

    remote = ts_kvstore.for_local(os.path.abspath(item_dir))  # in a bucket: its nodes read from there
    base = ts.KvStore.open(remote or f"file://{os.path.abspath(item_dir)}/").result()
    manifest = ts.ocdbt.dump(base, context=context).result()
    versions = manifest.get("versions") or []
    out: dict[str, ChunkLocation] = {}
    zarrays: dict[str, dict] = {}
    inline: dict[str, bytes] = {}
    root = versions[-1].get("root", {}).get("location") if versions else None
    pending = [(root, b"")] if root else []
    while pending:
        where, prefix = pending.pop()
        node = ts.ocdbt.dump(base, where, context=context).result()
        for entry in node.get("entries", []):
            key = prefix + _bytes(entry.get("key", b""))
            if "location" in entry:  # an interior node's child; its keys follow the common prefix
                pending.append((entry["location"], prefix + _bytes(entry.get("subtree_common_prefix", b""))))
            elif "indirect_value" in entry:
                out[key.decode("utf-8", "replace")] = parse_location(item_dir, entry["indirect_value"])
            elif key.endswith(b"/.zarray") and "inline_value" in entry:
                name = key[: -len(b"/.zarray")].decode("utf-8", "replace")
                try:
                    zarrays[name] = json_text.loads(entry["inline_value"], f"{item_dir}: {name}/.zarray")
                except json_text.JsonTooDeep:
                    raise
                except FormatError:
                    pass  # TensorStore reads it and says what is wrong
            elif "inline_value" in entry:
                inline[key.decode("utf-8", "replace")] = bytes(entry["inline_value"])
    if remote:
        ts_kvstore.settle(item_dir)
    return ItemIndex(out, zarrays, inline)


def no_special_files(item_dir: str, depth: int = 10) -> None:
    """An UnsafeItem error when the item's folders (`depth` levels: `<item>/<array>/<chunk>`,
    `<item>/ocdbt.process_<i>/d/<file>`, zarr v3's `<array>/c/<i>/<j>/...`) hold anything but
    plain files and folders (links followed): TensorStore
    reading a FIFO or a device named like a chunk would wait forever or read without end."""
    pending = [(item_dir, depth)]
    while pending:
        folder, left = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as e:
            raise CheckpointError(f"{folder}: cannot list the item: {e.strerror}") from e
        for entry in entries:
            if entry.is_dir():
                if left > 1:
                    pending.append((entry.path, left - 1))
            elif not entry.is_file():
                raise UnsafeItem(f"{entry.path}: not a regular file (a FIFO, device, socket or dangling link) "
                                  f"in the checkpoint item; it is not read")


def _list_folders(item_dir: str) -> ItemIndex:
    """The `ItemIndex` of an item without OCDBT: every `<array>/.zarray` and its chunk files."""
    out: dict[str, ChunkLocation] = {}
    zarrays: dict[str, dict] = {}
    try:
        names = sorted(os.listdir(item_dir))
    except OSError as e:
        raise CheckpointError(f"{item_dir}: cannot list the item: {e.strerror}") from e
    for name in names:
        folder = os.path.join(item_dir, name)
        meta = os.path.join(folder, ".zarray")
        if not os.path.isfile(meta):
            continue
        try:
            with open_regular_file(meta) as f:
                zarrays[name] = json_text.loads(f.read(), meta)
        except (json_text.JsonTooDeep, NotRegular):
            raise  # before TensorStore waits on it or walks it
        except (OSError, FormatError):
            continue  # TensorStore reads it and says what is wrong
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_file() and not entry.name.startswith("."):
                    out[f"{name}/{entry.name}"] = ChunkLocation(entry.path, 0, entry.stat().st_size)

    return ItemIndex(out, zarrays, {})


def _bytes(x) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()
