"""`python -m hybridckpt ...`: the same as the `hybridckpt` command."""

from hybridckpt.cli import run

run()
