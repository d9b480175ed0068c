"""A destination in object storage (`s3://bucket/prefix`, `gs://...`, any fsspec URL): an export
that appears complete or not at all, and replaces only what hybridckpt wrote.

`writers.destination.Destination(url, ...)` is one of these. The writer writes as it does locally,
into a spool folder (`tempfile`'s folder, `TMPDIR`: never beside the destination). Each file a
writer closes through `io.sequential_file` (safetensors shards, DCP `.distcp` files, torch.save
archives: the bulk of every export) and each raw chunk file of our store or a MaxText target
(`containers.orbax.chunk_files` calls `sequential_file.closed`: the bulk of an import) is
uploaded as soon as it is closed and removed from the spool, so the spool holds the files being
written (at most one chunk per writer thread, `lazy.parallel.write_pool`), not the step. A chunk written into Orbax's
temporary folders (`<N>.orbax-checkpoint-tmp/<item>.orbax-checkpoint-tmp/<array>/<chunk>`) goes
up under the name Orbax's rename at its commit gives it (`final_name`); `commit()` checks that the
rename happened. The OCDBT databases TensorStore writes (a compressed import) never enter the
spool: TensorStore writes them to the bucket itself (`io.remote.ts_writes`: the spool is registered
on entry; `_claim` lists each database folder in the staging marker before TensorStore writes
there, the commit lists what it wrote). The rest (JSON files, indexes, DCP `.metadata`, `.zarray`
and Orbax's metadata files) goes up at `commit()`:

1. **Checked.** The prefix is refused when it is a source's URL, lies in one or holds one; when it
   holds objects, unless `overwrite` and every one is ours (listed by our commit marker, or by
   the staging marker of an export cut short: `io.remote.commit`); anything else is named and
   never replaced, as for a local folder (`writers.ownership`).
2. **Staging marker first.** `<prefix>/.hybridckpt-staging` names the job and lists every old
   object of ours it will remove and, rewritten before each upload, every object it writes
   (chunks by their folder: rewritten once per array, not per chunk): nothing is touched that it
   does not list first. From
   now on readers refuse the prefix (`io.remote.commit.check_complete`) and the objects are
   recognisable as ours, even after a crash.
3. **Old export out, new one in place.** The old commit marker goes first, then the old objects
   (before the first new object goes up); each spooled file is streamed up (`upload_file`: a multipart
   upload of `PART_BYTES` parts, one part in memory; aborted on error) under its own name.
   Objects are written in place, not under a staging prefix copied afterwards: a store has no
   rename, and a server-side copy would cost the export's bytes again.
4. **Commit marker last.** `<prefix>/.hybridckpt-export` lists every object and its size; then
   the staging marker is deleted. Only now is the prefix complete.

A failure in 2-4 deletes what this job wrote (the objects it listed as it wrote them, once the
uploads running in other threads have ended, then the staging marker) and raises one CheckpointError naming the URL and the reason; where even that
fails (the server gone), the staging marker stays and names what is ours: the next export with
`--overwrite` removes it; so does an interrupt of the CLI (Ctrl-C, SIGTERM: the spool is removed
and the process exits at once, `io.interrupts`), held only while the commit marker is written.
An `--overwrite` that fails after step 3 has removed the old export (no
rename puts it back). No lock: two jobs writing one prefix at once are not detected (the second
sees the first's staging marker only if it starts after it).

One process only; our store saved under `jax.distributed` goes through its subclass
`writers.remote_shared.SharedRemoteDestination` (each process uploads its own chunks, process 0
writes the markers once all agree).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable

from hybridckpt.errors import CheckpointError, ConfigError
from hybridckpt.io import byte_source, interrupts, sequential_file
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import ts_writes, urls
from hybridckpt.io.remote.urls import RemoteUrl
from hybridckpt.writers import ownership

PART_BYTES = 64 << 20  # each part of a multipart upload (S3's minimum is 5 MiB), the bytes held in memory


class RemoteDestination:
    """The remote counterpart of `Destination` (same use: `with dest as spool:` ... `commit()`)."""

    def __init__(self, url: RemoteUrl, *, overwrite: bool = False, sources: Iterable = (), primary: bool = True,
                 token: str | None = None, marker: bool = False):
        import uuid

        if not primary:
            raise ConfigError(f"{url}: a RemoteDestination is one process's: under jax.distributed every "
                              f"process writes through a writers.remote_shared.SharedRemoteDestination")
        self.url = url
        self.dst = str(url)
        self.overwrite = overwrite
        self.sources = [os.fspath(s) for s in sources if s]
        self.token = token or uuid.uuid4().hex[:8]
        self.tmp: str | None = None
        self.committed = False
        self._fs = None
        self._lock = threading.Lock()  # (writers close files from their threads: `--writers N`)
        self._begun = self._failed = False
        self._old: set[str] = set()  # the old export's objects this job removes
        self._planned: set[str] = set()  # what this job writes (the staging marker lists it first)
        self._folders: set[str] = set()  # folders ("a/b/") of the chunks uploaded early, in the staging marker
        self._written: list[str] = []  # what this job wrote (or began to), in order
        self._sizes: dict[str, int] = {}  # uploaded object -> bytes
        self._early: dict[str, str] = {}  # uploaded from an Orbax temporary folder: its name -> spool name
        self._native: set[str] = set()  # folders ("a/b/") TensorStore writes in the bucket itself (`ts_writes`)
        self._redirect: ts_writes.Redirect | None = None
        self._inflight = 0  # uploads running (in writers' and readers' threads)
        self._idle = threading.Condition(self._lock)
        self._job: dict = {}

    @property
    def fs(self):
        if self._fs is None:
            self._fs = urls.filesystem(self.url)
        return self._fs

    # -- opening ---------------------------------------------------------------------------------
    def preflight(self) -> RemoteDestination:
        """Step 1 of the module doc, so a job can refuse before it reads anything."""
        check_not_over_sources(self.url, self.sources)
        self._check_existing()
        return self

    def _check_existing(self) -> markers.Listing:
        try:
            listing = markers.list_prefix(self.fs, self.url)
        except (OSError, ValueError) as e:  # (s3fs: PermissionError, a connection refused, ...)
            raise CheckpointError(f"{self.dst}: cannot list the destination: {_reason(e)}") from None
        if listing.empty:
            return listing
        extra = listing.foreign()
        if extra:
            shown = ", ".join(repr(n) if not n.isprintable() else n[:80] for n in extra[:5])
            more = ", ..." if len(extra) > 5 else ""
            raise CheckpointError(f"{self.dst}: holds {len(extra)} object{'s' if len(extra) != 1 else ''} not "
                                  f"written by hybridckpt: {shown}{more}; only a prefix hybridckpt wrote is "
                                  f"replaced: remove {'it' if len(extra) == 1 else 'them'} or choose another destination")
        if not self.overwrite:
            what = (f"holds an export hybridckpt has not finished ({listing.staging_job})"
                    if listing.staging is not None else "holds an export")
            raise CheckpointError(f"{self.dst}: {what}; pass overwrite=True to replace it",
                                  cli=f"{self.dst}: {what}; pass --overwrite to replace it")
        return listing

    def __enter__(self) -> str:
        self.preflight()
        self.tmp = tempfile.mkdtemp(prefix=f"hybridckpt-spool-{self.token}-")
        interrupts.add_temporary(self.tmp)
        sequential_file.CLOSED.append(self._closed)
        self._redirect = ts_writes.Redirect(self.tmp, self.url, final_folder, self._claim)
        ts_writes.redirect(self._redirect)
        return self.tmp

    # -- uploading -------------------------------------------------------------------------------
    def _closed(self, path: str) -> None:
        """A writer closed `path` complete (`io.sequential_file.CLOSED`, an import's chunk files:
        `containers.orbax.chunk_files`): upload it now when it is in this spool, under the name
        it will have once Orbax has renamed its temporary folders (`final_name`), and remove the
        local copy (the spool holds the files being written)."""
        if self.tmp is None or not path.startswith(self.tmp + os.sep) or self._failed:
            return
        spooled = os.path.relpath(path, self.tmp).replace(os.sep, "/")
        name = final_name(spooled)
        if ownership.ORBAX_TMP in name:  # (in a temporary folder of a layout not known here: at commit)
            return
        if name != spooled:
            with self._lock:
                self._early[name] = spooled
        self._guarded(lambda: self._upload(name, local=path))

    def _claim(self, folder: str) -> None:
        """TensorStore is about to write objects directly in `folder` ("a/b/", `io.remote.ts_writes`:
        an OCDBT database of a compressed import): steps 1-2 of the module doc first, then the
        folder listed in the staging marker (once), so its objects are ours even after a crash."""
        def claim() -> None:
            with self._lock:
                if self._failed:
                    raise CheckpointError(f"{self.dst}: upload failed, nothing committed")
                if not self._begun:
                    self._begin()
                if folder not in self._native:
                    self._native.add(folder)
                    self._folders.add(folder)
                    self._put(markers.STAGING, self._staging())

        self._guarded(claim)

    def _native_objects(self) -> dict[str, int]:
        """The objects TensorStore wrote directly in the claimed folders: name -> bytes."""
        out: dict[str, int] = {}
        self.fs.invalidate_cache()
        for folder in sorted(self._native):
            try:
                found = self.fs.find(self.url.child(folder.rstrip("/")).path, maxdepth=1, detail=True)
            except FileNotFoundError:
                continue
            for full, info in found.items():
                name = folder + full.rstrip("/").rsplit("/", 1)[-1]
                if info.get("type", "file") == "file":
                    out[name] = int(info.get("size") or 0)
        return out

    def _guarded(self, step) -> None:
        """Run an upload step; any failure deletes what this job wrote and is one CheckpointError."""
        try:
            step()
        except BaseException as e:
            if self.committed:
                raise
            self._failed = True
            self._clean()
            if not isinstance(e, Exception):  # Ctrl-C, SIGTERM: cleaned, then as usual (`io.interrupts`)
                raise
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{self.dst}: upload failed, nothing committed: {_reason(e)}") from None

    def _upload(self, name: str, local: str | None = None) -> None:
        """Step 2 (on the first file) and 3 of the module doc for one spooled file: the object
        `name`, from `local` (default: the spool's file of that name)."""
        local = local or os.path.join(self.tmp, *name.split("/"))
        with self._lock:
            if self._failed:  # (another thread's upload failed: what it cleans must stay cleaned)
                raise CheckpointError(f"{self.dst}: upload failed, nothing committed")
            if not self._begun:
                self._begin()
            if name not in self._planned:
                self._plan(name)
                self._written.append(name)
            self._inflight += 1
        try:
            size = upload_file(self.fs, local, self.url.child(name).path)
        finally:
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()
        with self._lock:
            self._sizes[name] = size
        os.remove(local)

    def _plan(self, name: str) -> None:
        """List the object `name` in the staging marker before it goes up (under the lock)."""
        folder = name.rsplit("/", 1)[0] + "/" if name in self._early else None
        self._planned.add(name)
        if folder is None or folder not in self._folders:  # (a chunk's folder: listed once)
            self._folders.update([folder] if folder else [])
            self._put(markers.STAGING, self._staging())

    def _begin(self) -> None:
        """Check the prefix again, write the staging marker, remove the old export of ours."""
        listing = self._check_existing()  # again: what is there may have changed meanwhile
        self._old = set(listing.objects)
        self._job = {"id": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                     "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._put(markers.STAGING, self._staging())
        self._begun = True
        if listing.has_marker_object:
            self.fs.rm_file(self.url.child(markers.MARKER).path)
        for name in sorted(self._old):
            self.fs.rm_file(self.url.child(name).path)

    # -- closing ---------------------------------------------------------------------------------
    def commit(self) -> None:
        """Upload what is left of the spool, then the commit marker (steps 3-4 of the module doc)."""
        byte_source.check_watches()  # after the last read: a source that changed is not committed
        if self._failed:
            raise CheckpointError(f"{self.dst}: upload failed, nothing committed")

        def finish() -> None:
            self._check_renamed()
            for name in _spooled(self.tmp):
                self._upload(name)
            for name, size in self._native_objects().items():  # (written by TensorStore: listed)
                with self._lock:
                    self._sizes[name] = size
                    self._written.append(name)
            if not self._begun:  # (an export of no files at all)
                self._begin()
            with interrupts.committing():  # (an interrupt waits for the marker and the staging's removal)
                self._written.append(markers.MARKER)
                self._put(markers.MARKER, markers.body(self._sizes, sizes=self._sizes))
                self.fs.rm_file(self.url.child(markers.STAGING).path)
                self.committed = True  # (an interrupt held meanwhile is raised after: nothing to clean)

        self._guarded(finish)

    def _staging(self) -> bytes:
        """The staging marker: every object planned (the chunks uploaded early: by their folders)
        and every old object this job removes."""
        listed = {n for n in self._planned if n not in self._early}
        return markers.body(listed | self._old, job=self._job, folders=self._folders)

    def _check_renamed(self) -> None:
        """Every object uploaded early from an Orbax temporary folder has its folder in the spool
        under the final name now (Orbax renamed it at its commit), and no second file there."""
        for name, spooled in sorted(self._early.items()):
            folder = os.path.join(self.tmp, *name.split("/")[:-1])
            if not os.path.isdir(folder) or os.path.exists(os.path.join(self.tmp, *spooled.split("/"))):
                raise CheckpointError(f"{self.dst}: {name} was uploaded from {spooled}, which Orbax did "
                                      f"not rename to {name.rsplit('/', 1)[0]}/; nothing committed")

    def _put(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.url.child(name).path, data)

    def _clean(self) -> None:
        """Delete what this job wrote (best effort), the staging marker last: kept when an object
        could not be deleted, so what is left is still recognisable as ours."""
        if not self._begun:
            return
        if not self._delete_written():
            try:
                self.fs.rm_file(self.url.child(markers.STAGING).path)
                self.committed = True  # (an interrupt held meanwhile is raised after: nothing to clean)
            except Exception:
                pass

    def _delete_written(self) -> bool:
        """Delete the objects this job wrote (best effort), once the uploads running in other
        threads have ended (none lands after the cleaning); whether one could not be deleted."""
        with self._lock:
            while self._inflight:
                self._idle.wait()
        left = False
        try:
            native = list(self._native_objects())  # (TensorStore's objects: found by listing)
        except Exception:
            native, left = [], bool(self._native)
        for name in [*reversed(self._written), *native]:
            try:
                self.fs.rm_file(self.url.child(name).path)
            except FileNotFoundError:
                pass
            except Exception:
                left = True
        return left

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._closed in sequential_file.CLOSED:
            sequential_file.CLOSED.remove(self._closed)
        if self._redirect is not None:
            ts_writes.release(self._redirect)
            self._redirect = None
        if not self.committed and not self._failed:
            self._failed = True
            self._clean()  # (a writer's own error after some files went up)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            interrupts.discard_temporary(self.tmp)
            self.tmp = None


def upload_file(fs, local: str, remote: str, part_bytes: int | None = None) -> int:
    """Stream the local file `local` to the object `remote` (fsspec path) as a multipart upload of
    `part_bytes` parts (default `PART_BYTES`): one part read at a time, so memory holds at most
    about two parts (the one read, the one the backend buffers); an error aborts the open upload
    (`discard`), so no part is left billed on the server. Returns the bytes uploaded."""
    part = part_bytes or PART_BYTES
    out = fs.open(remote, "wb", block_size=part)
    done = 0
    try:
        with open(local, "rb") as f:
            while chunk := f.read(part):
                out.write(chunk)
                done += len(chunk)
                del chunk
        out.close()
    except BaseException:
        discard = getattr(out, "discard", None)
        try:
            if discard is not None:
                discard()  # (s3fs: AbortMultipartUpload)
            out.closed = True  # (discarded: not to be completed when the object is collected)
        except Exception:
            pass
        raise
    return done


def check_not_over_sources(url: RemoteUrl, sources: Iterable[str]) -> None:
    """A CheckpointError when the prefix `url` is a source's URL, lies inside one or holds one."""
    d = str(url).rstrip("/")
    for src in sources:
        s_url = urls.parse(src)
        if s_url is None or s_url.scheme != url.scheme:
            continue
        s = str(s_url).rstrip("/")
        if d == s or d.startswith(s + "/") or s.startswith(d + "/"):
            what = "is the source" if d == s else "is inside the source" if d.startswith(s + "/") else "holds the source"
            raise CheckpointError(f"{url}: the destination {what} {src}; write it somewhere else")


def final_name(spooled: str) -> str:
    """The object name of the spool file `spooled` ("/"-separated) once Orbax has committed its
    save: a step folder `<N>.orbax-checkpoint-tmp[-<t>]` and an item folder `<item>.orbax-
    checkpoint-tmp[-<t>]` in it lose the suffix (Orbax's own rename, `_get_final_directory`,
    for the spool is a local folder: `writers.ownership`'s patterns); any other name is itself.
    Only the first two parts are looked at: an array's folder name is the checkpoint's data."""
    parts = spooled.split("/")
    if len(parts) < 3 or not ownership.STEP_TMP.fullmatch(parts[0]) or not ownership.ITEM_TMP.fullmatch(parts[1]):
        return spooled
    parts[0], parts[1] = (p.split(ownership.ORBAX_TMP, 1)[0] for p in parts[:2])
    return "/".join(parts)


def final_folder(spooled: str) -> str | None:
    """The object folder of the spool folder `spooled` ("/"-separated) after Orbax's rename
    (`final_name`), or None while it is still in a temporary folder of a layout not known here."""
    name = final_name(spooled.rstrip("/") + "/_")[:-2]
    return None if ownership.ORBAX_TMP in name else name


def _spooled(folder: str) -> list[str]:
    """Relative, "/"-separated names of the files under the spool (sorted); a symlink or special
    file a writer left is refused (an object store holds bytes only)."""
    out = []
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if os.path.islink(path) or not os.path.isfile(path):
                raise CheckpointError(f"{rel}: not a plain file; an object store holds bytes only")
            if rel in (markers.MARKER, markers.STAGING):
                continue
            out.append(rel)
    return sorted(out)


def _reason(e: BaseException) -> str:
    text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    return text
