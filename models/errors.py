"""The errors the model families raise: the project's own family (`hybridckpt.errors`), which is
the one thing of `hybridckpt` the families import."""

from __future__ import annotations

from hybridckpt.errors import ConfigError, HybridCkptError, UnknownModelError

__all__ = ["ConfigError", "HybridCkptError", "UnknownModelError"]
