"""hybridckpt: training checkpoints between parallel layouts and frameworks, as sharded JAX arrays."""

from hybridckpt.errors import HybridCkptError

__version__ = "0.1.0"
__all__ = ["HybridCkptError", "__version__"]
