"""One process of a 2-process `jax.distributed` import (run by tests/jobs/test_multiprocess.py).

usage: multiprocess_worker.py PROCESS_ID PORT SRC DST MESH OUT_JSON PLATFORM LOCAL_DEVICES

PLATFORM `cpu`: LOCAL_DEVICES simulated CPU devices; otherwise (`cuda`) the GPUs the parent gave
this process in CUDA_VISIBLE_DEVICES. With HYBRIDCKPT_TEST_TOUCH=PATH and HYBRIDCKPT_TEST_FLAG=FLAG,
process 1 gives PATH a new mtime right after it first opens it and process 0 first opens it after
that (a source rewritten in place
while this process reads it); HYBRIDCKPT_TEST_CONFIG=FILE is the import's `config`; a failed import is reported in OUT_JSON as "error" (exit 3).
With HYBRIDCKPT_TEST_RESTORE=MESH both processes then restore DST onto MESH (over both processes'
devices) and report the bytes each read and, per param leaf, each of its shards here (index,
SHA-256 of its bytes).
"""

import json
import os
import sys
import time

pid, port, src, dst, mesh, out, platform, local = sys.argv[1:9]
os.environ["JAX_PLATFORMS"] = platform
if platform == "cpu":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(local)}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))

from hybridckpt import jobs  # noqa: E402
from hybridckpt.errors import HybridCkptError  # noqa: E402
from hybridckpt.io import byte_source  # noqa: E402
from hybridckpt.io.byte_source import count_reads  # noqa: E402

touch, flag = os.environ.get("HYBRIDCKPT_TEST_TOUCH"), os.environ.get("HYBRIDCKPT_TEST_FLAG")
if touch:
    import contextlib

    _held, first = byte_source._held, []

    @contextlib.contextmanager
    def held_touched(path):
        """Process 1 opens `touch` first, then gives it a new mtime and writes `flag`; process 0
        opens it only after `flag` is there (so it sees the file as it is after the change)."""
        if path == touch and not first and jax.process_index() == 0:
            for _ in range(1200):  # (at most 120 s: then on, and the test sees the order fail)
                if os.path.exists(flag):
                    break
                time.sleep(0.1)
        with _held(path) as fd:  # the job has now recorded the file as it is (`byte_source._held`)
            if path == touch and not first:
                first.append(os.path.exists(flag))
                if jax.process_index() == 1:
                    st = os.stat(touch)
                    os.utime(touch, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
                    open(flag, "w").close()
            yield fd

    byte_source._held = held_touched

error, step = None, None
with count_reads() as counter:
    try:
        step = jobs.import_checkpoint(src, dst, mesh=mesh, config=os.environ.get("HYBRIDCKPT_TEST_CONFIG")).step
    except HybridCkptError as e:
        error = str(e)
restored, restore_read = None, None
if error is None and os.environ.get("HYBRIDCKPT_TEST_RESTORE"):
    import hashlib

    import numpy as np

    import hybridckpt
    from hybridckpt import naming

    with count_reads() as again:
        _, r = hybridckpt.restore(dst, os.environ["HYBRIDCKPT_TEST_RESTORE"])
    restore_read = sum(v for k, v in again.items() if isinstance(k, str))
    restored = {k: [[[[s.start or 0, s.stop] for s in shard.index],
                     hashlib.sha256(np.ascontiguousarray(np.asarray(shard.data)).tobytes()).hexdigest()]
                    for shard in a.addressable_shards]
                for k, a in naming.flatten(r.params).items()}
with open(out, "w") as f:
    json.dump(
        {
            "restored": restored,
            "restore_read": restore_read,
            "process_index": jax.process_index(),
            "local_devices": len(jax.local_devices()),
            "platform": jax.local_devices()[0].platform,
            "bytes_read": {k: v for k, v in counter.items() if isinstance(k, str)},
            "step": step,
            "error": error,
            "touch_order_ok": bool(touch) and bool(first) and first[0] == (jax.process_index() == 0),
        },
        f,
    )
if error is None:
    jax.distributed.shutdown()
sys.exit(3 if error else 0)
