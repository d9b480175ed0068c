"""What TensorStore writes into a remote destination's spool goes to the bucket instead.

A remote destination (`writers.remote.RemoteDestination`) spools what a writer writes and uploads
it; raw chunk files go up one by one as they are closed. The chunks TensorStore writes itself (an
import with `--compression zstd`: an OCDBT database of compressed chunks per item,
`store.stream_orbax`) are not files we close: spooled, they would hold the whole step on the
local disk. So the destination registers its spool here (`redirect`) and the save rewrites each
OCDBT kvstore spec it builds (`to_bucket`): an OCDBT `base` / `manifest` that is a `file` kvstore
in a registered spool becomes the bucket's kvstore (`ts_kvstore.kvstore_spec`) at the object
name the destination gives that folder (`Redirect.name`: the name after Orbax's rename of its
temporary folders, as for the raw chunks). Before the spec is returned the destination is told
(`Redirect.claim`, with the folder's object prefix) so its staging marker lists the folder
before TensorStore writes its first object there: a reader refuses the prefix until the commit
marker exists, and a failure finds (and deletes) what TensorStore wrote.

Only the OCDBT databases are redirected (their data files `d/<id>`, their `manifest.ocdbt`);
the small metadata Orbax writes beside them (`_METADATA`, `_sharding`, `array_metadatas/`,
`_CHECKPOINT_METADATA`) stays in the spool and is uploaded at the commit.

Why in-place OCDBT writes are safe here: every data file TensorStore writes has a new random
name and is never rewritten; only `manifest.ocdbt` is rewritten (once per OCDBT commit: the small
tiles' batches, then the merge of the item), by one writer each (each process its own
`ocdbt.process_<i>/`, the merge the item's own), so no two writers race for a manifest; and
nothing reads the prefix before the commit marker exists, so a manifest seen half-way through
the save is never seen at all. The merge (`store.stream_orbax._merge_in_bucket`, Orbax's own
`merge_ocdbt_per_process_files` with the bucket's kvstores) writes only the item's
`manifest.ocdbt` (and B-tree nodes under its `d/`), pointing at the processes' data files.
A TensorStore error while writing a redirected database is one CheckpointError (`write_error`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from hybridckpt.errors import CheckpointError
from hybridckpt.io.remote.ts_kvstore import kvstore_spec
from hybridckpt.io.remote.urls import RemoteUrl


@dataclass(frozen=True)
class Redirect:
    """One spool folder whose TensorStore databases are written to `url`. `name`: a spool-relative,
    "/"-separated folder -> its object folder under `url` (None: stays in the spool, e.g. a
    temporary folder whose final name is not known); `claim`: called with an object folder
    ("a/b/", relative to `url`) before TensorStore writes anything in it."""

    spool: str
    url: RemoteUrl
    name: Callable[[str], str | None]
    claim: Callable[[str], None]


_lock = threading.Lock()
_redirects: list[Redirect] = []


def redirect(r: Redirect) -> None:
    """Send TensorStore's writes under `r.spool` to `r.url` until `release(r)`."""
    with _lock:
        _redirects.append(r)


def release(r: Redirect) -> None:
    """`r` no longer redirects; TensorStore's requests while it did are set aside (not reads)."""
    from hybridckpt.io.remote import ts_kvstore

    with _lock:
        if r in _redirects:
            _redirects.remove(r)
    ts_kvstore.set_aside()


def _find(path: str) -> tuple[Redirect, str] | None:
    """The redirect whose spool holds the local folder `path`, and the folder's object name ("a/b/")."""
    path = os.path.abspath(path)
    with _lock:
        found = [r for r in _redirects if path.startswith(r.spool.rstrip(os.sep) + os.sep)]
    if not found:
        return None
    r = found[0]
    name = r.name(os.path.relpath(path, r.spool).replace(os.sep, "/").strip("/"))
    return None if not name else (r, name.rstrip("/") + "/")


def bucket_of(path: str) -> tuple[RemoteUrl, str] | None:
    """(destination URL, object folder "a/b/") of the local spool folder `path`, or None when
    `path` is in no redirected spool."""
    found = _find(path)
    return None if found is None else (found[0].url, found[1])


def write_error(path: str, e: BaseException) -> BaseException:
    """TensorStore's error `e` (a ValueError: the server gone, a write refused) while writing the
    databases of the spool folder `path` to a bucket, as one CheckpointError naming the
    destination; any other error, or one for a folder not redirected, is `e` itself."""
    found = _find(path) if isinstance(e, ValueError) else None
    if found is None:
        return e
    text = (str(e).splitlines() or [type(e).__name__])[0][:300]
    return CheckpointError(f"{found[0].url}: upload failed, nothing committed: TensorStore: {text}")


def to_bucket(kvstore: dict) -> dict:
    """The OCDBT kvstore spec `kvstore` (Orbax's `build_kvstore_tspec` form, or any spec holding
    one: a zarr spec's `kvstore`), its `file` base and manifest in a redirected spool replaced,
    in place, by the bucket's kvstore at the same object folder; also claimed (the module doc).
    Returns `kvstore`; anything else unchanged."""
    if kvstore.get("driver") != "ocdbt":
        inner = kvstore.get("kvstore")
        if isinstance(inner, dict):
            to_bucket(inner)
        return kvstore
    base = kvstore.get("base")
    path = _file_path(base)
    found = None if path is None else _find(path)
    if found is None:
        return kvstore
    r, folder = found
    for sub in (folder, folder + "d/"):  # (the manifest, and TensorStore's data files: "d/<id>")
        r.claim(sub)
    spec = kvstore_spec(r.url.child(folder.rstrip("/")))
    kvstore["base"] = spec
    if "manifest" in kvstore:
        kvstore["manifest"] = dict(spec)
    return kvstore


def _file_path(base) -> str | None:
    """The local folder of a `file` kvstore (a spec dict or a "file://..." URL), or None."""
    if isinstance(base, dict) and base.get("driver") == "file":
        return str(base.get("path", "")) or None
    if isinstance(base, str) and base.startswith("file://"):
        return base[len("file://"):] or None
    return None
