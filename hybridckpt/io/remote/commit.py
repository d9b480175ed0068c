"""How an export written to object storage says it is complete: two small JSON objects.

Object stores have no rename, so a remote export (`writers.remote`) is written in place under its
prefix and made visible by a commit marker written LAST; what readers and `--overwrite` look at:

- `STAGING` (`<prefix>/.hybridckpt-staging`), written FIRST, before any other object: the job
  (`job`, `pid`, `host`, `since`) and `files`, every object (relative, "/"-separated) the job is
  about to write or remove, and `folders` ("a/b/"), folders whose objects (directly in them) it
  writes one by one as they come (an import's chunk files: one rewrite per array, not per chunk),
  and `trees` ("12/"), folders every object below which (at any depth) it may write: an import
  from several processes (`writers.remote_shared`), whose other processes' chunks the one
  process writing the marker does not see, lists the step's folder so.
  While it is there the prefix is an unfinished export of ours: readers refuse it
  (`check_complete`), `--overwrite` may remove exactly the objects it lists.
- `MARKER` (`<prefix>/.hybridckpt-export`, the same name and `files` list as a local export's
  marker, `writers.ownership.MARKER`) plus `sizes` (object -> bytes): written after every object
  it lists, then `STAGING` is deleted. A prefix with `MARKER` and no `STAGING` is complete.

Both are small (at most `MAX_MARKER_BYTES`) and read as untrusted data: a name in them is compared
with the names listed under the prefix, never opened as a path of its own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridckpt.errors import CheckpointError
from hybridckpt.io.remote.urls import RemoteUrl

MARKER = ".hybridckpt-export"  # (= writers.ownership.MARKER: a downloaded export stays ours locally)
STAGING = ".hybridckpt-staging"
MAX_MARKER_BYTES = 64 * 1024 * 1024
MAX_LISTED = 1_000_000  # objects listed under a prefix before it is called foreign


@dataclass(frozen=True)
class Listing:
    """What is under a prefix: `objects` (relative name -> bytes, the two markers excepted),
    `marker` / `staging`: the files each marker lists (None: absent or not ours), `staging_job`:
    who wrote the staging marker (one line) or ""."""

    objects: dict[str, int]
    marker: frozenset[str] | None
    staging: frozenset[str] | None
    staging_job: str = ""
    has_marker_object: bool = False
    has_staging_object: bool = False
    staging_folders: frozenset[str] = frozenset()  # ("a/b/": the objects directly in it are listed)
    staging_trees: frozenset[str] = frozenset()  # ("a/": every object below it, at any depth, is listed)

    @property
    def empty(self) -> bool:
        return not self.objects and not self.has_marker_object and not self.has_staging_object

    def foreign(self) -> list[str]:
        """The objects hybridckpt did not write (sorted): all of them unless a marker of ours
        lists them; with both markers, either may list an object (an overwrite cut short)."""
        listed = (self.marker or frozenset()) | (self.staging or frozenset())
        if self.marker is None and self.staging is None:
            extra = sorted(self.objects)
            if self.has_marker_object:
                extra.insert(0, MARKER)
            if self.has_staging_object:
                extra.insert(0, STAGING)
            return extra
        return sorted(n for n in self.objects if n not in listed and not self._in_folder(n))

    def _in_folder(self, name: str) -> bool:
        return "/" in name and (name.rsplit("/", 1)[0] + "/" in self.staging_folders
                                or any(name.startswith(t) for t in self.staging_trees))


def list_prefix(fs, url: RemoteUrl) -> Listing:
    """List the objects under `url` (one paged listing, at most `MAX_LISTED` looked at) and read
    the two markers when they are there."""
    base = url.path.rstrip("/") + "/"
    objects: dict[str, int] = {}
    fs.invalidate_cache()  # (fsspec caches listings: what is there now, not at the last look)
    try:
        found = fs.find(url.path, withdirs=False, detail=True)
    except FileNotFoundError:
        found = {}
    for full, info in found.items():
        full = full.split("://", 1)[-1]
        if not full.startswith(base):
            continue  # (the prefix itself as an object: `s3://b/out` a file, not a folder)
        objects[full[len(base):]] = int(info.get("size") or 0)
        if len(objects) > MAX_LISTED:
            break
    has_marker, has_staging = MARKER in objects, STAGING in objects
    marker = _read(fs, url.child(MARKER), objects.pop(MARKER, None))
    staging_size = objects.pop(STAGING, None)
    staging = _read(fs, url.child(STAGING), staging_size)
    return Listing(objects, None if marker is None else frozenset(marker["files"]),
                   None if staging is None else frozenset(staging["files"]),
                   _job(staging) if staging is not None else "", has_marker, has_staging,
                   _folders(staging) if staging is not None else frozenset(),
                   _folders(staging, "trees") if staging is not None else frozenset())


def check_complete(fs, url: RemoteUrl) -> None:
    """A CheckpointError when the prefix `url` holds an export hybridckpt has not finished
    writing (its `STAGING` marker is there): what a reader calls before it trusts the objects."""
    try:
        staged = fs.exists(url.child(STAGING).path)
    except FileNotFoundError:
        staged = False
    if staged:
        raise CheckpointError(
            f"{url}: holds an export hybridckpt has not finished writing ({STAGING} is there, "
            f"{MARKER} is not final): write it again, or remove it with export ... --overwrite")


def require_committed(fs, url: RemoteUrl) -> None:
    """A CheckpointError unless our store at `url` was uploaded complete: the prefix, or the one
    above it (a URL naming one step folder, `s3://b/ck/12`), carries the commit marker `MARKER`
    and no `STAGING`; what a reader of our store in a bucket calls before it reads anything (a
    store without the marker may be one cut short whose listing looks whole)."""
    parent = url.path.rsplit("/", 1)[0] if "/" in url.path else None
    for where in (url, RemoteUrl(url.scheme, parent) if parent else None):
        if where is None:
            continue
        check_complete(fs, where)
        try:
            if fs.exists(where.child(MARKER).path):
                return
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{url}: cannot look for its commit marker {MARKER}: {str(e)[:300]}") from None
    raise CheckpointError(
        f"{url}: no {MARKER} commit marker: not a checkpoint hybridckpt finished uploading (import it "
        f"to the bucket again, or download it and read the local copy)")


def body(files, *, sizes: dict[str, int] | None = None, job: dict | None = None, folders=(), trees=()) -> bytes:
    """The JSON of a marker: `files` (sorted), with `sizes` (the commit marker) or `job`,
    `folders` and `trees` (staging)."""
    from importlib import metadata

    try:
        version = metadata.version("hybridckpt")
    except metadata.PackageNotFoundError:
        version = "unknown"
    out: dict = {"written_by": "hybridckpt", "version": version, "files": sorted(files)}
    if sizes is not None:
        out["sizes"] = {k: sizes[k] for k in sorted(sizes)}
    if job is not None:
        out["job"] = job
    if folders:
        out["folders"] = sorted(folders)
    if trees:
        out["trees"] = sorted(trees)
    return (json.dumps(out, indent=0) + "\n").encode()


def _read(fs, url: RemoteUrl, size: int | None) -> dict | None:
    """A marker's JSON when it is one of ours (`written_by`, a list of string `files`), else None."""
    if size is None or size > MAX_MARKER_BYTES:
        return None
    try:
        parsed = json.loads(fs.cat_file(url.path))
    except (OSError, ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict) or parsed.get("written_by") != "hybridckpt":
        return None
    files = parsed.get("files")
    if not isinstance(files, list) or not all(isinstance(x, str) for x in files):
        return None
    return parsed


def _folders(staging: dict, key: str = "folders") -> frozenset[str]:
    """The staging marker's `folders` (or `trees`: "a/b/" each), nothing when it is not a list of
    such strings."""
    folders = staging.get(key)
    if not isinstance(folders, list) or not all(isinstance(x, str) and x.endswith("/") and len(x) > 1
                                                 for x in folders):
        return frozenset()
    return frozenset(folders)


def _job(staging: dict) -> str:
    job = staging.get("job")
    if not isinstance(job, dict):
        return "an unknown job"
    text = f"job {job.get('id')} (pid {job.get('pid')} on {job.get('host')}, since {job.get('since')})"
    return text if text.isprintable() and len(text) < 300 else "an unknown job"
