"""A restore of a store with more chunk files than the process may open at once (issue 42's
restore keeps each file's descriptor open for its reads: `io.open_files`). Before, every chunk
file's descriptor stayed open until the job's end, so a restore of more chunk files than the soft
`RLIMIT_NOFILE` (1024 on many systems; a 7B model with AdamW is some 14,000 chunk files) failed
with "Too many open files"; now at most half the limit stay open. Run in a child process whose
soft limit is 40, against the same restore in this process, byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
from meshes import fit

import hybridckpt
from hybridckpt.demo import sample_path
from hybridckpt.jobs.import_ import import_checkpoint

LIMIT = 40  # the child's soft RLIMIT_NOFILE: JAX's own files and 20 kept descriptors fit

CHILD = """
import hashlib, json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import jax, numpy as np, hybridckpt
_, r = hybridckpt.restore(sys.argv[1], sys.argv[2])
leaves = jax.tree_util.tree_flatten_with_path((r.params, r.opt_state))[0]
print(json.dumps({{jax.tree_util.keystr(k): hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
                   for k, v in leaves if hasattr(v, "shape")}}))
"""


def _digests(params, opt_state) -> dict[str, str]:
    leaves = jax.tree_util.tree_flatten_with_path((params, opt_state))[0]
    return {jax.tree_util.keystr(k): hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
            for k, v in leaves if hasattr(v, "shape")}


def test_a_restore_reads_more_chunk_files_than_it_may_open_at_once(tmp_path):
    ck = str(tmp_path / "ck")
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2,tp=2"))
    chunk_files = [f for _, _, fs in os.walk(ck) for f in fs if re.fullmatch(r"\d+(\.\d+)*", f)]
    assert len(chunk_files) > LIMIT  # (more than the child may open at once, whatever else it opens)
    mesh = fit("fsdp=4")
    out = subprocess.run([sys.executable, "-c", CHILD.format(limit=LIMIT), ck, mesh], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    _, r = hybridckpt.restore(ck, mesh)
    want = _digests(r.params, r.opt_state)
    assert got == want and len(want) > 10
