"""One process of a 2-process `jax.distributed` job reading a source from the test S3 server (run
by tests/remote/test_multihost_bucket.py).

usage: multihost_worker.py SPEC_JSON

SPEC: {"process", "port" (the coordinator's), "local" (CPU devices of this process), "env" (this
process's S3 environment: its own counting proxy as the endpoint), "heartbeat_s", "out" (JSON
written at the end), "commands": [argv of `hybridckpt`, ...], and the faults: "kill_after_gets"
(SIGKILL this process after that many ranged GETs of data objects, mid-import) or "rewrite":
{"key", "endpoint"} (after this process's first GET of that object, rewrite it in the bucket at
the same size through the server itself, not the proxy), and for an upload to a bucket
"kill_after_uploads" (SIGKILL this process once that many of its objects went up) or
"fail_after_uploads" (every later upload of this process raises an injected ConnectionResetError;
counted per command, in the command of index "fail_command" only when that is given)}.

After each command a GET of `/hybridckpt-test-mark/<i>` goes to the proxy, so its log splits
per command. Each command runs through `hybridckpt.cli.main`, its stdout and stderr captured; OUT gets, per
command, {"argv", "rc", "stdout", "stderr", "renames" (the destination renames this process
made: `writers.destination._rename_noreplace`, the commit of a local destination), "closed"
(the files this process's own writers closed in a spool, `io.sequential_file.CLOSED`, by the
object name each has once Orbax commits: `writers.remote.final_name`), "needed"
(object key -> the byte ranges this process's readers asked `io.remote.ranged.read_ranges` for,
before coalescing: what its devices need)}.
"""

import contextlib
import io
import json
import os
import signal
import sys
import urllib.error
import urllib.request

MARK = "hybridckpt-test-mark"
spec = json.load(open(sys.argv[1]))
os.environ.update(spec["env"])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(spec['local'])}"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{spec['port']}", num_processes=2,
                           process_id=int(spec["process"]), heartbeat_timeout_seconds=int(spec.get("heartbeat_s", 100)))

import re  # noqa: E402
import threading  # noqa: E402

from hybridckpt.cli import main  # noqa: E402
from hybridckpt.io import sequential_file  # noqa: E402
from hybridckpt.io.remote import ranged  # noqa: E402
from hybridckpt.writers import destination, remote  # noqa: E402

renames: list[str] = []
needed: dict[str, list] = {}  # object key -> the byte ranges this process's readers asked for
data_gets = [0]
_get, _rename, _read_ranges = ranged.get, destination._rename_noreplace, ranged.read_ranges


def read_ranges(obj, ranges, sink):
    needed.setdefault(obj.key, []).extend([a, b] for a, b in ranges)
    return _read_ranges(obj, ranges, sink)


def get(obj, start, end):
    data = _get(obj, start, end)
    if obj.key.endswith((".safetensors", ".distcp")):
        data_gets[0] += 1
        if spec.get("kill_after_gets") and data_gets[0] >= spec["kill_after_gets"]:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-import, without a goodbye
        rewrite = spec.get("rewrite")
        if rewrite and obj.key == rewrite["key"] and not rewrite.get("done"):
            import s3fs

            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": rewrite["endpoint"]}, skip_instance_cache=True)
            old = fs.cat_file(obj.key)
            fs.pipe_file(obj.key, bytes(b ^ 0xFF for b in old[:8]) + old[8:])  # same size, other bytes
            rewrite["done"] = True
    return data


closed: list[str] = []
uploads, upload_lock = [0], threading.Lock()
_upload_file = remote.upload_file


def record_closed(path):
    found = re.search(r"hybridckpt-spool-[^/]+/(.+)$", path)
    if found:
        closed.append(remote.final_name(found[1]))


def upload_file(fs, local, path, part_bytes=None):
    with upload_lock:
        place = uploads[0]
        uploads[0] += 1
    if spec.get("fail_after_uploads") is not None and place >= spec["fail_after_uploads"] \
            and spec.get("fail_command", len(results)) == len(results):
        raise ConnectionResetError("connection reset by peer (injected)")
    n = _upload_file(fs, local, path, part_bytes)
    if spec.get("kill_after_uploads") and place + 1 >= spec["kill_after_uploads"]:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-upload, without a goodbye
    return n


def rename(src, dst):
    renames.append(dst)
    return _rename(src, dst)


ranged.get, ranged.read_ranges, destination._rename_noreplace = get, read_ranges, rename
remote.upload_file = upload_file
sequential_file.CLOSED.append(record_closed)
results = []
for argv in spec["commands"]:
    out, err = io.StringIO(), io.StringIO()
    del renames[:], closed[:]
    uploads[0] = 0
    needed.clear()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    try:  # a mark in this process's proxy log: the requests after it are the next command's
        urllib.request.urlopen(f"{spec['env']['AWS_ENDPOINT_URL']}/{MARK}/{len(results)}", timeout=30).close()
    except urllib.error.HTTPError:
        pass
    results.append({"argv": argv, "rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "renames": list(renames), "closed": list(closed), "needed": dict(needed)})
with open(spec["out"], "w") as f:
    json.dump({"process_index": jax.process_index(), "local_devices": len(jax.local_devices()),
               "results": results}, f)
jax.distributed.shutdown()
