"""The CLI's "peak memory" figure is the process's own peak, not the peak of whatever started it.

Linux carries the forking process's high-water RSS into the child's `ru_maxrss` at exec, so a CLI
started from a process that once held a lot of memory (a notebook, a trainer, a benchmark driver)
printed that process's peak as its own.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np

PARENT_MIB = 600


def test_the_peak_memory_is_the_process_own_not_its_parents():
    big = np.ones(PARENT_MIB * 2**20, dtype=np.uint8)  # this process touches 600 MiB, then frees it
    big[::4096] = 2
    del big
    code = (
        "import resource\n"
        "from hybridckpt.cli.output import peak_rss_gib\n"
        "print(peak_rss_gib() * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    ours_mib, maxrss_mib = map(float, out.split())
    assert maxrss_mib >= PARENT_MIB  # what ru_maxrss says here: the parent's peak (the bug)
    assert ours_mib < 200, ours_mib  # a Python with hybridckpt's CLI output module: tens of MiB
