"""The root of the project's exception family, defined here so that `models` imports nothing
from `hybridckpt`.

`hybridckpt.errors` re-exports both classes and derives the rest of the family (FormatError,
MappingError, ...) from `HybridCkptError`, so `hybridckpt.errors.ConfigError is
models.errors.ConfigError` and the CLI's one-line message and exit code 2 cover model errors too.
"""

from __future__ import annotations


class HybridCkptError(Exception):
    """Base of every error hybridckpt raises on purpose."""


class ConfigError(HybridCkptError):
    """A model config is missing or describes an unknown architecture."""


class UnknownModelError(ConfigError):
    """A config names an architecture no family of `models` implements: a format may then go on
    model-agnostic (tensors under the source's own names) instead of failing."""
