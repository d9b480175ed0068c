"""The one JSON parser for text from a checkpoint: a depth limit, one line on any failure.

`json.loads` recurses once per nesting level: a file of 100k `[` is a RecursionError (a
traceback, not a message), and one nested just under the interpreter's limit parses and then
breaks the first reader that walks it recursively. Every JSON value hybridckpt reads from a
source (metadata.json, `_METADATA`, `.zarray`, indexes, configs, trainer states) goes through
`loads`: nesting deeper than `MAX_JSON_DEPTH` is refused in one line naming the file, before any
reader walks it. Real files nest a few levels (an HF config.json 3-4, Orbax's `_METADATA` and a
zarr `.zarray` 3-5).
"""

from __future__ import annotations

import json

from hybridckpt.errors import FormatError

MAX_JSON_DEPTH = 64  # nesting levels ([ and {) a checkpoint's JSON may have


class JsonTooDeep(FormatError):
    """JSON nested past `MAX_JSON_DEPTH` levels."""


def _too_deep(where: str, max_depth: int) -> JsonTooDeep:
    return JsonTooDeep(
        f"{where}: JSON nested deeper than {max_depth} levels; not a file this format writes"
    )


def depth_of(value, stop: int) -> int:
    """Nesting depth of a parsed JSON `value` (a scalar is 0, `[]` is 1), walked without
    recursion; stops counting once past `stop`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def loads(text: str | bytes | bytearray, where: str, *, max_depth: int = MAX_JSON_DEPTH, **kwargs):
    """The JSON value of `text` (bytes are UTF-8); `where` names the file (and key) in errors.

    FormatError (one line) when the text is not UTF-8 or not JSON; `JsonTooDeep` when it nests
    past `max_depth`. `kwargs` go to `json.loads` (`object_pairs_hook`, ...).
    """
    try:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8")
        # a cheap bound first: JSON cannot nest deeper than its count of brackets and braces
        if text.count("[") + text.count("{") <= max_depth:
            return json.loads(text, **kwargs)
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise _too_deep(where, max_depth) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise FormatError(f"{where}: not valid JSON: {str(e)[:200]}") from None
    if depth_of(value, max_depth) > max_depth:
        raise _too_deep(where, max_depth)
    return value
