"""The one exception family of hybridckpt.

Every error a user can cause (bad input, a layout that does not fit, a mesh that cannot divide a
tensor) is a `HybridCkptError`; its message names the file, the key, what was expected and what
was found. The CLI turns these into a one-line message and exit code 2.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "CheckpointError",
    "ConfigError",
    "FormatError",
    "HybridCkptError",
    "MappingError",
    "MeshError",
    "UnknownModelError",
    "UnsafePickleError",
    "short_repr",
]


def short_repr(obj: object, n: int = 120) -> str:
    """`repr(obj)` cut to about `n` characters per string or object, for error messages (a name
    read from a hostile file can be megabytes long)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = n
    return r.repr(obj)


class HybridCkptError(Exception):
    """Base of every error hybridckpt raises on purpose."""


class ConfigError(HybridCkptError):
    """A model config is missing or describes an unknown architecture."""


class UnknownModelError(ConfigError):
    """A config names an architecture no family of `hybridckpt.models` implements: a format may
    then go on model-agnostic (tensors under the source's own names) instead of failing."""


class FormatError(HybridCkptError):
    """A source file or folder does not match the format it claims (names file and key)."""


class UnsafePickleError(FormatError):
    """A pickle asked for a global or construct outside the allow-list; nothing was executed."""


class MappingError(HybridCkptError):
    """A name/layout rule did not apply: no rule for a key, a rule that matched nothing, a shape."""


class MeshError(HybridCkptError):
    """A mesh cannot be built or cannot divide a tensor dimension."""


class CheckpointError(HybridCkptError):
    """An Orbax checkpoint is missing, incomplete, or does not match the requested tree."""

