"""A source in object storage seen as a local folder: every format reads it unchanged.

`local_path(src)` returns `src` itself for a local path; for a URL (`s3://bucket/prefix`, any
fsspec URL) it returns a local *view* of the prefix, made once per process:

1. one listing of the prefix (fsspec `find`: one paginated LIST for S3), refused past
   `MAX_OBJECTS` objects; every key below the prefix is an untrusted name, checked by
   `io.paths.check_relative` (no absolute path, no `..`, no NUL or backslash), so no key can
   place a file outside the view;
2. each *metadata* object (a name without a data suffix: `config.json`, an index, DCP's
   `.metadata`, a tracker file) downloaded whole into the view, at most `MAX_METADATA_BYTES`
   each (a larger one without a data suffix is left in the bucket and read by ranges, as data);
3. each *data* object (`DATA_SUFFIXES`: `.safetensors`, `.distcp`, `.bin`, `.pt`, ...) a sparse
   placeholder of its listed size, registered with `io.byte_source`, which sends every read of
   it to `io.remote.ranged` (ranged GETs). A placeholder holds no byte of the object: opening it
   any other way (`io.regular_file.open_regular`, what a reader that walks a whole file uses) is
   refused with one line, never read as zeros.

Our store's raw chunk files (zarr v2 chunks below a folder with `.zarray`) and the data files of
an OCDBT database (`<db>/d/<name>` beside `manifest.ocdbt`) are data too: our reader reads raw
chunks through `io.byte_source` (`containers.orbax.reader.raw_chunks`); what only TensorStore
decodes (compressed chunks, an OCDBT index, MaxText's train state) TensorStore reads from the
bucket itself, never from the view (`io.remote.ts_kvstore`, `containers.orbax.ts_spec`). Error messages that name a file of the view
name its URL instead (`displayed`). The views are removed when the process exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass

from hybridckpt.errors import CheckpointError, FormatError
from hybridckpt.io.paths import check_relative
from hybridckpt.io.remote import commit, ranged, urls
from hybridckpt.io.remote.urls import RemoteUrl

MAX_OBJECTS = 100_000  # objects below one source prefix
MAX_METADATA_BYTES = 64 << 20  # a metadata object downloaded whole: at most this size
DATA_SUFFIXES = (
    ".safetensors", ".distcp", ".bin", ".pt", ".pth", ".ckpt", ".pdparams", ".pdopt", ".npy", ".npz",
    ".msgpack", ".h5", ".gguf",
)

_lock = threading.Lock()
_views: dict[tuple[str, str], View] = {}
_placeholders: dict[str, ranged.RemoteObject] = {}  # local placeholder path -> its object


@dataclass(frozen=True)
class View:
    """A local view of `url`: `root` the folder made for it, `path` what the formats open
    (`root` itself, or the one file when the URL names an object)."""

    url: RemoteUrl
    root: str
    path: str


def local_path(src: object) -> object:
    """`src` itself when it is a local path; for an object-storage URL, the local view's path
    (made on first use, see the module doc)."""
    url = urls.parse(src)
    if url is None:
        return src
    key = (str(url), ranged.host_of(url))
    with _lock:
        view = _views.get(key)
        if view is None:
            view = _views[key] = _make(url)
    return view.path


def remote_object(path: str) -> ranged.RemoteObject | None:
    """The object a placeholder file of a view stands for, or None (a local file)."""
    return _placeholders.get(path) if _placeholders else None


def refuse_whole_read(path: str) -> None:
    """FormatError when `path` is a placeholder of a view (a reader about to read it whole)."""
    obj = remote_object(path)
    if obj is None:
        return
    if obj.size > MAX_METADATA_BYTES and not path.lower().endswith(DATA_SUFFIXES):
        raise FormatError(f"{obj.url}: {obj.size} bytes, more than the {MAX_METADATA_BYTES} bytes a metadata file "
                          f"of a source in object storage may hold (byte ranges only past it)")
    raise FormatError(f"{obj.url}: this reader reads the file whole, which a source in object storage does not "
                      f"allow (byte ranges only); copy the checkpoint to a local folder")


def url_of(path: object) -> str | None:
    """The URL a view's local path stands for, or None."""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    for view in list(_views.values()):
        if text is not None and (text == view.root or text.startswith(view.root + os.sep)):
            return str(view.url) + text[len(view.root):] if view.path == view.root else str(view.url)
    return None


def displayed(text: str) -> str:
    """`text` with each view's local folder written as its URL (for messages)."""
    for view in list(_views.values()):
        if view.path != view.root:
            text = text.replace(view.path, str(view.url))
        text = text.replace(view.root, str(view.url))
    return text


def _list(url: RemoteUrl, fs) -> tuple[dict[str, int], dict[str, str | None]]:
    """Every object below `url` (or `url` itself when it is one): relative name -> size, and
    relative name -> ETag."""
    try:
        found = fs.find(url.path, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as e:  # noqa: BLE001 - the client's error, in one line
        raise CheckpointError(f"{url}: cannot list the source: {ranged._brief(e)}") from None
    if not found:
        raise CheckpointError(f"{url}: no objects there (nothing to read)")
    if len(found) > MAX_OBJECTS:
        raise CheckpointError(f"{url}: {len(found)} objects below the prefix, more than the {MAX_OBJECTS} a source may hold")
    objects: dict[str, int] = {}
    etags: dict[str, str | None] = {}
    for key, info in found.items():
        if info.get("type", "file") != "file":
            continue
        key = key.strip("/")
        if key == url.path:  # the URL names one object
            return {"": int(info.get("size") or 0)}, {"": ranged.etag_of(info)}
        if not key.startswith(url.path + "/"):
            raise FormatError(f"{url}: the listing returned {key!r}, not below the prefix")
        rel = check_relative(key[len(url.path) + 1:], f"{url}: object name")
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise FormatError(f"{url}/{rel}: listed size {size!r} is not a byte count")
        objects[rel] = size
        etags[rel] = ranged.etag_of(info)
    for rel in objects:  # `a` and `a/b` both: a file and a folder of one name
        parent = rel.rsplit("/", 1)[0] if "/" in rel else None
        if parent is not None and parent in objects:
            raise FormatError(f"{url}: {parent!r} is both an object and a folder of objects")
    return objects, etags


def _is_data(rel: str, size: int, zarr_folders: frozenset[str] = frozenset(),
             ocdbt_folders: frozenset[str] = frozenset()) -> bool:
    return (rel.lower().endswith(DATA_SUFFIXES) or size > MAX_METADATA_BYTES or _is_zarr_chunk(rel, zarr_folders)
            or _is_ocdbt_data(rel, ocdbt_folders))


def _is_ocdbt_data(rel: str, ocdbt_folders: frozenset[str]) -> bool:
    """Whether `rel` is a data file of an OCDBT database (`<db>/d/<name>`, `<db>` a folder holding
    `manifest.ocdbt`: an Orbax item or one of its `ocdbt.process_<i>` sub-databases): read by
    ranges (our raw reader) or by TensorStore from the bucket (`io.remote.ts_kvstore`), never
    downloaded whole."""
    parts = rel.split("/")
    return len(parts) >= 3 and parts[-2] == "d" and "/".join(parts[:-2]) in ocdbt_folders


def _is_zarr_chunk(rel: str, zarr_folders: frozenset[str]) -> bool:
    """Whether `rel` is a chunk file of a zarr v2 array (our store's raw import, Orbax without
    OCDBT): it lies below a folder holding `.zarray` and its name past that folder is the chunk's
    grid position (`0.1.2`, or `0/1/2` with the "/" separator). Such files are data, read by
    ranges; a reader that opens one whole (TensorStore) is stopped by `containers.orbax.reader`."""
    parts = rel.split("/")
    for cut in range(len(parts) - 1, 0, -1):
        if "/".join(parts[:cut]) in zarr_folders:
            return all(p.replace(".", "").isdigit() and p.isascii() for p in parts[cut:])
    return False


def _make(url: RemoteUrl) -> View:
    # s3fs's and botocore's own retry loops off: ours (`ranged.get`) retries, and names the range
    fs = urls.filesystem(url, config_kwargs={"retries": {"total_max_attempts": 1}}) if url.scheme in ("s3", "s3a") \
        else urls.filesystem(url)
    fs.retries = 1
    objects, etags = _list(url, fs)
    if commit.STAGING in objects:  # an export or import of ours cut short: never read as a checkpoint
        commit.check_complete(fs, url)
    host = ranged.host_of(url)
    ranged.add_total(host, 1 + len(objects) // 1000, 0)  # the LIST pages (1000 keys a page)
    root = tempfile.mkdtemp(prefix="hybridckpt-view-")
    atexit.register(shutil.rmtree, root, True)
    single = "" in objects
    if single:
        name = os.path.basename(url.path) or "object"
        objects = {check_relative(name, f"{url}: object name"): objects[""]}
        etags = {next(iter(objects)): etags[""]}
    zarr_folders = frozenset(rel[: -len("/.zarray")] for rel in objects if rel.endswith("/.zarray"))
    ocdbt_folders = frozenset(rel[: -len("/manifest.ocdbt")] for rel in objects if rel.endswith("/manifest.ocdbt"))
    fetch: list[tuple[str, ranged.RemoteObject]] = []
    for rel, size in sorted(objects.items()):
        local = os.path.join(root, rel)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        obj = ranged.RemoteObject(url if single else url.child(rel), fs, size, host, etags.get(rel))
        with open(local, "wb") as f:
            f.truncate(size)  # sparse: no byte of the object is on this disk
        if _is_data(rel, size, zarr_folders, ocdbt_folders):
            _placeholders[local] = obj
        elif size:
            fetch.append((local, obj))
    _download(fetch)
    return View(url, root, os.path.join(root, next(iter(objects))) if single else root)


def _download(fetch: list[tuple[str, ranged.RemoteObject]]) -> None:
    """Download the metadata objects whole (each one GET, through `ranged`: bounded in flight,
    retried) into their files of the view."""
    def one(item: tuple[str, ranged.RemoteObject]) -> None:
        local, obj = item
        data = ranged.get(obj, 0, obj.size)
        with open(local, "r+b") as f:
            f.write(data)

    if not fetch:
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(ranged.MAX_IN_FLIGHT, len(fetch))) as pool:
        list(pool.map(one, fetch))


def shown(path: object) -> object:
    """A view's local path as the URL it stands for (what a summary or message names), else `path`."""
    return url_of(path) or path
