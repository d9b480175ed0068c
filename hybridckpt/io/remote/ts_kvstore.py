"""Object-storage URLs as TensorStore kvstore specs: what TensorStore alone reads, read in place.

Most formats read a bucket through `io.remote.view` (metadata downloaded, data by our ranged GETs).
What only TensorStore decodes (a compressed zarr array, an OCDBT database: MaxText's train state,
a store imported with `--compression`, a training loop's OCDBT save) is read by TensorStore
itself, from the bucket, with the spec made here instead of a `file` kvstore of the view (whose
placeholders hold no byte of the objects):

- `s3://bucket/prefix` -> `{"driver": "s3", "bucket", "path", "endpoint", "aws_region"}`: the
  endpoint named explicitly from `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (TensorStore's s3
  driver does not take it from the environment for a spec without one, so an S3-compatible
  server would not be reached), the region from `AWS_REGION` / `AWS_DEFAULT_REGION` (needed
  with an endpoint, where TensorStore cannot ask the bucket; "us-east-1" when neither is set);
- `gs://bucket/prefix` -> `{"driver": "gcs", "bucket", "path"}`; under `STORAGE_EMULATOR_HOST`
  (a GCS emulator) TensorStore's `TENSORSTORE_GCS_HTTP_URL` is set to it unless the user set it
  (TensorStore names its GCS endpoint by that variable only: there is no spec member for it).

Transient errors are retried `ranged.TRIES` times with a growing pause, as our own GETs (then
TensorStore's error, one line). Credentials are TensorStore's own business, found as the AWS and Google SDKs find them
(environment, config files, instance metadata): never read, put into a spec, printed or logged
here (where `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` are set, the spec names the SDK's
`environment` provider, the first of its default chain, by type only). Any other scheme is one ConfigError. `requests()` reads TensorStore's own counters of the
GETs and bytes it made (`/tensorstore/kvstore/<driver>/read`, `.../bytes_read`), so a job adds
them to the requests it reports per host (`ranged.add_total`).
"""

from __future__ import annotations

import os
import threading

from hybridckpt.errors import ConfigError
from hybridckpt.io.remote import urls
from hybridckpt.io.remote.urls import RemoteUrl

DRIVERS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # URL scheme -> TensorStore kvstore driver
DEFAULT_REGION = "us-east-1"

_set_gcs_url: list[str | None] = [None]  # the TENSORSTORE_GCS_HTTP_URL this module set, if any
_seen_lock = threading.Lock()
_seen: dict[str, tuple[int, int]] = {}  # TensorStore's counts already added to a host (`settle`)


def s3_endpoint() -> str | None:
    """The S3-compatible server named by the environment (what `urls.filesystem` gives s3fs), or None."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def kvstore_spec(url: RemoteUrl | str, *, folder: bool = True) -> dict:
    """The TensorStore kvstore spec of `url` (a `RemoteUrl` or its text); `folder`: the path ends
    with "/" (a prefix whose keys are below it, as a zarr array's or an OCDBT database's)."""
    if isinstance(url, str):
        parsed = urls.parse(url)
        if parsed is None:
            raise ConfigError(f"{url}: not an object-storage URL")
        url = parsed
    driver = DRIVERS.get(url.scheme)
    if driver is None:
        raise ConfigError(f"{url}: TensorStore reads and writes object storage only as s3:// or gs:// "
                          f"(not {url.scheme}://); copy it to a local folder first")
    path = url.path.split("/", 1)[1] if "/" in url.path else ""
    if folder and path and not path.endswith("/"):
        path += "/"
    from hybridckpt.io.remote import ranged

    spec: dict = {"driver": driver, "bucket": url.bucket, "path": path,
                  # as our own GETs (`ranged.TRIES`): TensorStore's default (32 tries, up to 32 s
                  # apart) would leave a job cut from its server waiting for minutes, not one line
                  f"{driver}_request_retries": {"max_retries": ranged.TRIES, "initial_delay": f"{ranged.BACKOFF_S}s",
                                                "max_delay": f"{ranged.BACKOFF_S * 2 ** ranged.TRIES}s"}}
    if driver == "s3":
        endpoint = s3_endpoint()
        if endpoint:
            spec["endpoint"] = endpoint
        spec["aws_region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
            # (the default chain's first source; named, so the SDK does not go on to log on stderr
            # that it found no ~/.aws files: a job's error stays one line)
            spec["aws_credentials"] = {"type": "environment"}
    elif os.environ.get("STORAGE_EMULATOR_HOST"):
        emulator = os.environ["STORAGE_EMULATOR_HOST"]
        current = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
        if not current or current == _set_gcs_url[0]:  # (the user's own value is kept)
            _set_gcs_url[0] = os.environ["TENSORSTORE_GCS_HTTP_URL"] = (
                emulator if "://" in emulator else f"http://{emulator}")
    return spec


def for_local(path: str) -> dict | None:
    """The kvstore spec of the object-storage prefix a local view's `path` (a folder of
    `io.remote.view`) stands for, or None for a local path (read by TensorStore's `file` driver)."""
    from hybridckpt.io.remote.view import url_of

    url = url_of(path)
    if url is None:
        return None
    spec = kvstore_spec(url)
    with _seen_lock:  # (what TensorStore read before this source is not its cost)
        if spec["driver"] not in _seen:
            _seen[spec["driver"]] = requests()[spec["driver"]]
    return spec


def requests() -> dict[str, tuple[int, int]]:
    """TensorStore's own counts so far in this process: driver ("s3", "gcs") -> (GET requests,
    bytes read). Differences of two calls are what TensorStore read in between."""
    import tensorstore as ts

    out: dict[str, tuple[int, int]] = {}
    for driver in sorted(set(DRIVERS.values())):
        got = {m["name"].rsplit("/", 1)[-1]: m for m in ts.experimental_collect_matching_metrics(
            f"/tensorstore/kvstore/{driver}/")}
        out[driver] = (_value(got.get("read")), _value(got.get("bytes_read")))
    return out


def _value(metric: dict | None) -> int:
    if not metric:
        return 0
    return int(sum(v.get("value", 0) for v in metric.get("values", ()) if isinstance(v.get("value", 0), int)))


def set_aside() -> None:
    """TensorStore's counts so far taken as seen and given to no host: called when the writes of a
    compressed import into a bucket end (`io.remote.ts_writes.release`), whose requests (manifest
    reads, conditional writes retried under load) are not a source's reads; unset aside, the next
    `settle` of a read gave them to that read's host (CI saw a store's read count 1.4x its bytes)."""
    with _seen_lock:
        _seen.update(requests())


def settle(path: str) -> None:
    """Add what TensorStore has read from object storage since the last call (its own counters,
    `requests`) to the requests of the host that `path` (a view's local path) is read from:
    the job's totals (`ranged.add_total`, the summary's `read from HOST`) and the `count_reads`
    counters (`io.byte_source`). Nothing for a local path. (Reads of two hosts by TensorStore at
    once are given to the one that settles first.)"""
    from hybridckpt.io import byte_source
    from hybridckpt.io.remote import ranged
    from hybridckpt.io.remote.view import url_of

    text = url_of(path)
    if text is None:
        return
    url = urls.parse(text)
    driver = DRIVERS.get(url.scheme) if url is not None else None
    if driver is None:
        return
    with _seen_lock:
        now = requests()[driver]
        before = _seen.get(driver, (0, 0))
        _seen[driver] = now
    count, nbytes = now[0] - before[0], now[1] - before[1]
    if count > 0 or nbytes > 0:  # (a GET counted at an earlier settle may deliver its bytes after it)
        host = ranged.host_of(url)
        ranged.add_total(host, count, nbytes)
        byte_source._count_requests(ranged.Requests(host, count, nbytes))
