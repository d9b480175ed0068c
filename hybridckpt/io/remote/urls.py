"""Object-storage URLs: which SRC/DST strings name a bucket, and the fsspec filesystem for one.

A URL is `<scheme>://<bucket>/<prefix>` with a scheme fsspec knows other than `file` (`s3`,
`gs`/`gcs`, `az`, `memory`, ...); everything else is a local path, as before. The backend package
is imported only here and only when a URL asks for it, so a user of local paths needs neither
fsspec nor s3fs/gcsfs; a missing backend is one ConfigError naming the extra that installs it.
Credentials are the backend's own business (environment, config files, instance metadata): they
are never read, printed or logged here. `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` (an
S3-compatible server) are honoured for `s3://` by passing them to s3fs explicitly; under
`STORAGE_EMULATOR_HOST` (a GCS emulator, which serves the JSON API only) `gs://` takes gcsfs's
plain filesystem, not the extended one that first asks a gRPC control API for each bucket's type.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hybridckpt.errors import ConfigError

_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
LOCAL_SCHEMES = frozenset({"file", "local"})
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # scheme -> `pip install hybridckpt[...]`


@dataclass(frozen=True)
class RemoteUrl:
    """One object-storage location: `scheme` (`s3`, `gs`, ...), `path` = `bucket/prefix` (no
    trailing slash, as fsspec names it)."""

    scheme: str
    path: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    def child(self, name: str) -> RemoteUrl:
        """The object or prefix `name` (a relative path already checked by `io.paths`) below this one."""
        return RemoteUrl(self.scheme, f"{self.path}/{name}" if self.path else name)


def parse(text: object) -> RemoteUrl | None:
    """The RemoteUrl `text` names, or None when it is a local path (a `file://` URL included)."""
    if not isinstance(text, str):
        text = os.fspath(text) if isinstance(text, os.PathLike) else None
        if not isinstance(text, str):
            return None
    m = _URL.match(text)
    if m is None or m.group(1) in LOCAL_SCHEMES:
        return None
    scheme, rest = m.group(1), m.group(2)
    if not rest.strip("/") or rest.startswith("/"):
        raise ConfigError(f"{text}: an object-storage URL needs a bucket: {scheme}://BUCKET/PREFIX")
    return RemoteUrl(scheme, rest.rstrip("/"))


def is_remote(text: object) -> bool:
    """Whether SRC/DST `text` names object storage rather than a local path."""
    return parse(text) is not None


def filesystem(url: RemoteUrl, **more):
    """The fsspec filesystem for `url`'s scheme, created fresh (no cross-job instance cache, so a
    killed connection is not reused), importing fsspec and its backend only now; `more`: options
    of the backend's own, added to ours (the S3 reader's `config_kwargs`)."""
    try:
        import fsspec
    except ImportError:
        raise ConfigError(
            f"{url}: reading or writing object storage needs fsspec: "
            f"pip install 'hybridckpt[{EXTRAS.get(url.scheme, 's3')}]'"
        ) from None
    options: dict = {"skip_instance_cache": True}
    if url.scheme in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
    options.update(more)
    try:
        if url.scheme in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
            from gcsfs.core import GCSFileSystem

            return GCSFileSystem(**options)
        return fsspec.filesystem(url.scheme, **options)
    except (ImportError, ValueError) as e:
        extra = EXTRAS.get(url.scheme)
        hint = f": pip install 'hybridckpt[{extra}]'" if extra else ""
        raise ConfigError(f"{url}: no fsspec backend for {url.scheme}:// ({e}){hint}") from None
