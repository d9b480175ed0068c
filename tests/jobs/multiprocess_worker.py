"""One process of a 2-process `jax.distributed` import (run by tests/jobs/test_multiprocess.py).

usage: multiprocess_worker.py PROCESS_ID PORT SRC DST MESH OUT_JSON PLATFORM LOCAL_DEVICES

PLATFORM `cpu`: LOCAL_DEVICES simulated CPU devices; otherwise (`cuda`) the GPUs the parent gave
this process in CUDA_VISIBLE_DEVICES.
"""

import json
import os
import sys

pid, port, src, dst, mesh, out, platform, local = sys.argv[1:9]
os.environ["JAX_PLATFORMS"] = platform
if platform == "cpu":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(local)}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))

from hybridckpt import jobs  # noqa: E402
from hybridckpt.io.byte_source import count_reads  # noqa: E402

with count_reads() as counter:
    summary = jobs.import_checkpoint(src, dst, mesh=mesh)
with open(out, "w") as f:
    json.dump(
        {
            "process_index": jax.process_index(),
            "local_devices": len(jax.local_devices()),
            "platform": jax.local_devices()[0].platform,
            "bytes_read": {k: v for k, v in counter.items() if isinstance(k, str)},
            "step": summary.step,
        },
        f,
    )
jax.distributed.shutdown()
