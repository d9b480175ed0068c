"""The errors the model families raise: the project's own family (`hybridckpt.errors`), which is
the one thing of `hybridckpt` the families import."""

from __future__ import annotations

from hybridckpt.errors import ConfigError, FormatError, HybridCkptError, UnknownModelError

__all__ = ["ConfigError", "FormatError", "HybridCkptError", "UnknownModelError"]
