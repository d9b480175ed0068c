"""The jobs behind the CLI and the public API, one module each.

- `open.open_checkpoint`: any checkpoint (ours included) as HF-named lazy tensors + optimizer
  slots + trainer metadata; the one way every other job reads a checkpoint.
- `import_.import_checkpoint`: into our Orbax store on a mesh, streamed.
- `export.export_checkpoint`: to one single-card safetensors folder, streamed (model-agnostic
  consolidation when there is no model config).
- `verify.verify` / `verify.verify_checksums`: compare two checkpoints; re-check ours on disk.
- `inspect.inspect`: what a checkpoint holds, from metadata.
- `logits.logits`: the forward pass, to check a conversion against the source framework.
- `restore.restore`: one of our checkpoints onto any mesh (`jobs.restore`), after checking the
  path is one (absent: nothing created; another format's: named, with the import to run).

Each job takes plain arguments and returns a summary or data; printing and exit codes live in
`hybridckpt.cli`. JAX, Flax and Orbax are imported inside the jobs that use them, so export,
inspect and verify between torch-side formats never load them.
"""

from hybridckpt.formats.model_config import load_config_file
from hybridckpt.jobs.export import ExportSummary, export_checkpoint
from hybridckpt.jobs.import_ import ImportSummary, import_checkpoint
from hybridckpt.jobs.inspect import inspect
from hybridckpt.jobs.logits import logits
from hybridckpt.jobs.open import Opened, open_checkpoint
from hybridckpt.jobs.verify import TensorDiff, compare_tensors, verify, verify_checksums

__all__ = [
    "ExportSummary",
    "ImportSummary",
    "Opened",
    "TensorDiff",
    "compare_tensors",
    "export_checkpoint",
    "import_checkpoint",
    "inspect",
    "load_config_file",
    "logits",
    "open_checkpoint",
    "verify",
    "verify_checksums",
]
