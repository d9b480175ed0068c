"""Tensor names as keys of our Orbax store: a name read from a checkpoint is never a path.

Orbax keeps each leaf of an item under its key path joined with "." (`params/<key>/` is the
folder of an array in a raw item, `<key>` its key in an OCDBT item). A model import's keys are
the family's tree paths; a model-agnostic import (no config) would key its leaves by the
SOURCE's tensor names, which are data from the file: a tensor named `/etc/cron.d/x` or
`../../x` must not become a folder.

`storage_keys(names)` gives every source name a key. A name is kept as it is (nested at its dots,
as before) when it is *plain*: every dot-separated part matches `PLAIN_PART` (ASCII letters,
digits, `_`, `-`; at most 100 characters, not starting with `-`), at most `MAX_KEY_CHARS` in all,
its first part does not start with the escape prefix `ESCAPE`, no other plain name extends it
(`a` beside `a.b`: the tree cannot hold both) and no other plain name equals it case-blind (a
case-insensitive filesystem would merge their folders). Every other name is stored under
`ESCAPE + sha256(name)[:40 hex]`, one part, and the original is recorded in
`trainer_state["tensor_names"]` (key -> name) so that export and inspect give it back exactly.
A plain `orbax.checkpoint` restore sees ordinary keys.

`check_leaf_key(key)` is the last line at the write boundary (every save, ours or a training
loop's): the joined key of a leaf must be one path component, no `/`, NUL, `.` or `..`, at most
`MAX_KEY_BYTES` bytes of UTF-8.

Reading, every store is untrusted (ours, MaxText's, any Orbax item): `metadata_leaf_names(meta,
where)` gives the joined name of every leaf an item's `_METADATA` lists, each checked as one
path component (`check_leaf_key`, at most `MAX_READ_KEY_BYTES`: a folder name) and no two alike
(two leaves of one name would read one array twice); `original_names` refuses a recorded
`tensor_names` entry that is not the escape of its name, or that gives two leaves one name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping

from hybridckpt.errors import CheckpointError, short_repr

PLAIN_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,99}\Z")
MAX_KEY_CHARS = 200  # a plain name longer than this is escaped (a folder name is <= 255 bytes)
MAX_READ_KEY_BYTES = 255  # the longest leaf key a read accepts (one folder name)
MAX_KEY_BYTES = 240  # the longest joined leaf key a save writes (prefixes like `0.mu.` included)
ESCAPE = "hcx_"  # the first characters of an escaped key; a plain name starting so is escaped too
NAMES_KEY = "tensor_names"  # trainer_state key: escaped key -> original source name


def escaped_key(name: str) -> str:
    """The key of a name that is not stored as itself."""
    return ESCAPE + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def is_plain(name: str) -> bool:
    """Whether `name` alone could be stored as its own key (see the module doc)."""
    if not isinstance(name, str) or not name or len(name) > MAX_KEY_CHARS or name.startswith(ESCAPE):
        return False
    return all(PLAIN_PART.match(part) for part in name.split("."))


def storage_keys(names: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> key for every name, key -> name for the escaped ones): see the module doc.
    Deterministic: the same names give the same keys, whatever their order."""
    names = set(names)
    odd = [n for n in names if not isinstance(n, str) or not n]
    if odd:
        raise CheckpointError(f"tensor name {short_repr(odd[0])} is not a non-empty string; it cannot be stored by name")
    names = sorted(names)
    plain = [n for n in names if is_plain(n)]
    plain_set = set(plain)
    escape = {n for n in names if n not in plain_set}
    for n in plain:  # `a` beside `a.b.c`: `a` is escaped (the tree keeps `a` as a node)
        parts = n.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in plain_set:
                escape.add(prefix)
    folded: dict[str, str] = {}
    for n in plain:
        if n in escape:
            continue
        first = folded.setdefault(n.casefold(), n)
        if first != n:  # same letters, other case: the later one (sorted) is escaped
            escape.add(n)
    keys: dict[str, str] = {}
    back: dict[str, str] = {}
    for n in names:
        if n not in escape:
            keys[n] = n
            continue
        key = escaped_key(n)
        if key in back:
            raise CheckpointError(f"tensor names {short_repr(back[key])} and {short_repr(n)} have the same storage key {key}")
        keys[n], back[key] = key, n
    return keys, back


def original_names(flat: Mapping[str, object], names: Mapping[str, str] | None) -> dict[str, object]:
    """`flat` (key -> value, as read from the store) re-keyed by the original source names that
    `names` (`trainer_state["tensor_names"]`) records for escaped keys."""
    if not names:
        return dict(flat)
    if not isinstance(names, Mapping) or not all(isinstance(v, str) for v in names.values()):
        raise CheckpointError(f"trainer_state[{NAMES_KEY!r}] is not a map of key -> tensor name")
    out: dict[str, object] = {}
    whose: dict[str, str] = {}  # name -> the key it came from
    for k, v in flat.items():
        name = k
        if k.startswith(ESCAPE) and k in names:
            name = names[k]
            if escaped_key(name) != k:
                raise CheckpointError(
                    f"trainer_state[{NAMES_KEY!r}]: key {short_repr(k)} is recorded for the name {short_repr(name)}, "
                    f"whose key is {escaped_key(name)}: the record was changed"
                )
        if name in whose:
            raise CheckpointError(
                f"trainer_state[{NAMES_KEY!r}]: leaves {short_repr(whose[name])} and {short_repr(k)} both give the "
                f"tensor name {short_repr(name)}; one would hide the other"
            )
        whose[name], out[name] = k, v
    return out


def check_leaf_key(key: str, where: str, max_bytes: int = MAX_KEY_BYTES) -> None:
    """A CheckpointError unless the joined leaf key `key` is one safe path component (see the
    module doc); `where` names the item."""
    problem = None
    if not isinstance(key, str):
        problem = f"is a {type(key).__name__}, not a name"
    elif not key or key in (".", ".."):
        problem = "is empty, '.' or '..'"
    elif "/" in key or "\\" in key or "\x00" in key:
        problem = "contains '/', '\\' or NUL"
    elif len(key.encode("utf-8", "surrogatepass")) > max_bytes:
        problem = f"is longer than {max_bytes} bytes"
    if problem is not None:
        raise CheckpointError(f"{where}: leaf key {short_repr(key)} {problem}; it would not be one folder inside the item")


def metadata_leaf_names(meta: Mapping, where: str) -> dict[str, Mapping]:
    """Leaf name -> its entry, for every leaf of an item's `_METADATA` (`meta`, parsed; `where`:
    the file): the name is the entry's `key_metadata` keys joined with ".", each checked as one
    safe path component (`check_leaf_key`); a malformed entry or two leaves of one name are a
    CheckpointError naming both."""
    tree = meta.get("tree_metadata", {})
    if not isinstance(tree, Mapping):
        raise CheckpointError(f"{where}: 'tree_metadata' is a {type(tree).__name__}, expected an object")
    out: dict[str, Mapping] = {}
    whose: dict[str, str] = {}
    for label, entry in tree.items():
        keys = entry.get("key_metadata") if isinstance(entry, Mapping) else None
        if not isinstance(keys, list) or not all(
            isinstance(k, Mapping) and isinstance(k.get("key"), (str, int)) and not isinstance(k.get("key"), bool)
            for k in keys
        ) or not isinstance(entry.get("value_metadata", {}), Mapping):
            raise CheckpointError(f"{where}: leaf {short_repr(label)}: expected key_metadata [{{'key': ...}}, ...] "
                                  f"and a value_metadata object")
        name = ".".join(str(k["key"]) for k in keys)
        check_leaf_key(name, f"{where}: leaf {short_repr(label)}", MAX_READ_KEY_BYTES)
        if name in whose:
            raise CheckpointError(
                f"{where}: leaves {short_repr(whose[name])} and {short_repr(label)} have the same name "
                f"{short_repr(name)}; one would be read for both"
            )
        whose[name], out[name] = str(label), entry
    return out
