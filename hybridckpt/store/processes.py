"""The processes of a `jax.distributed` job, as a writer needs them: who am I, wait for all, and
each one's small JSON report handed to all (`writers.remote_shared`'s agreement on a commit).

Everything goes through `jax.experimental.multihost_utils`, the collectives the save already
uses for its barriers (`store.save._barrier`): every process must make the same calls in the
same order. A process that never comes (killed) leaves the others waiting until JAX's
coordination service gives it up (its heartbeat timeout), as at any barrier of the save.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

MAX_REPORT_BYTES = 64 << 20  # one process's report (its object list: names and sizes)


class JaxProcesses:
    """`index`, `count`, `gather(report)` over the processes of this `jax.distributed` job."""

    @property
    def index(self) -> int:
        return jax.process_index()

    @property
    def count(self) -> int:
        return jax.process_count()

    def gather(self, report: Any) -> list[Any]:
        """Every process's `report` (JSON-able), in process order, on every process: the lengths
        first, then the UTF-8 bytes padded to the longest (`process_allgather` takes arrays of
        one shape), as int32 (jax runs without x64; uint8 is not every backend's)."""
        from jax.experimental import multihost_utils

        data = json.dumps(report, sort_keys=True).encode()
        if len(data) > MAX_REPORT_BYTES:
            data = json.dumps({"error": f"process {self.index}: its report is over {MAX_REPORT_BYTES} bytes"}).encode()
        sizes = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int32))).reshape(-1)
        padded = np.zeros(int(sizes.max()), np.int32)
        padded[: len(data)] = np.frombuffer(data, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
        return [json.loads(rows[i, : int(n)].astype(np.uint8).tobytes()) for i, n in enumerate(sizes)]
