"""Our store written to object storage by several processes of a `jax.distributed` job: each
process uploads the chunks it writes itself, one process commits.

`store.save.save_checkpoint(url, ...)` under `jax.distributed` uses a `SharedRemoteDestination`
on every process, with the same token and the processes' `group` (`store.processes.JaxProcesses`).
The markers are those of a single-process upload (`writers.remote`, `io.remote.commit`):

1. **Begun by process 0, before any upload.** Process 0 checks the prefix (empty, or with
   `overwrite` only objects of ours), writes the ONE staging marker `.hybridckpt-staging`, which
   lists, besides its own objects, the step's folder as a `tree` ("12/": every object below it
   is ours, whichever process wrote it), and removes the old export. Then every process learns
   whether that went well (`group.gather`: also the barrier: no process uploads before the staging
   marker is there); a refusal is one line on every process.
2. **Each process uploads what it writes.** Every process spools into its own local folder (never
   shared: hosts have their own disks) and uploads each raw chunk as it is closed
   (`writers.remote`'s hook), under its final name; at the commit, what is left in its spool
   (process 0: the metadata, the trainer state, the config files; another process: its own
   `array_metadatas/process_<i>`, named as Orbax's rename on process 0 names it). A compressed
   import's OCDBT databases are written by each process's TensorStore to the bucket itself
   (`io.remote.ts_writes`: its own `ocdbt.process_<i>/`, below the tree; process 0 merges them
   there in Orbax's finalize, after the barrier that follows every process's writes); each
   process lists what TensorStore wrote for it at the commit. Nothing goes
   through process 0 and nothing is copied. A failed upload is not raised at once (the other
   processes are still in the save's collectives): the process stops uploading, drops the
   chunks it still writes and reports the failure at the agreement.
3. **Agreed, committed by process 0.** Every process reports (`group.gather`) its first failure
   (an upload, a source file changed while read, `io.byte_source.check_watches`) or its
   objects with their sizes; only when no process failed does process 0 write the commit marker
   `.hybridckpt-export`, listing every process's objects, and delete the staging marker; its
   success is agreed again, so every process returns or fails together.

On any process's failure nothing is committed: each process deletes the objects it uploaded,
then process 0 deletes the staging marker once every process reports all its objects deleted.
Every process raises one CheckpointError naming the URL and the process that failed (the CLI
exits 2 on every process). A process killed outright (SIGKILL, a lost host) leaves the others
waiting at the next agreement until JAX's coordination service gives up (its heartbeat timeout):
what the processes uploaded stays, under the staging marker, so readers refuse the prefix and
the next import with `--overwrite` removes it (every object below the listed step folder).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hybridckpt.errors import CheckpointError, HybridCkptError
from hybridckpt.io import byte_source, interrupts, sequential_file
from hybridckpt.io.remote import commit as markers
from hybridckpt.io.remote import ts_writes
from hybridckpt.io.remote.urls import RemoteUrl
from hybridckpt.writers import ownership
from hybridckpt.writers.remote import RemoteDestination, _reason, _spooled, final_folder, final_name


class SharedRemoteDestination(RemoteDestination):
    """A `RemoteDestination` one of several processes writes (module doc); `group`: `index`,
    `count`, `gather(report) -> [report of each process]`; `tree`: the folder ("12/") every object of
    the other processes lies below."""

    def __init__(self, url: RemoteUrl, *, group, tree: str, **kw):
        kw.pop("primary", None)
        super().__init__(url, **kw)
        self.group = group
        self.primary = group.index == 0
        self.tree = tree if tree.endswith("/") else tree + "/"
        self._error: str | None = None  # this process's first failure (one line), reported at the agreement
        self._agreed = False  # the agreement ran: what it left is final

    # -- opening ---------------------------------------------------------------------------------
    def __enter__(self) -> str:
        mine = None
        if self.primary:
            try:
                self.preflight()
                self._begin()  # (the staging marker with the step's tree, the old export removed)
            except HybridCkptError as e:
                mine = str(e)
            except Exception as e:  # (s3fs: PermissionError, a connection refused, ...)
                mine = f"{self.dst}: cannot begin the upload: {_reason(e)}"
        reports = self.group.gather({"error": mine})
        if reports[0]["error"] is not None:
            if self._begun:
                self._clean()  # (the staging marker, when written)
            if mine is not None:
                raise CheckpointError(mine)
            raise CheckpointError(f"{self.dst}: nothing written: process 0 could not begin the upload "
                                  f"({reports[0]['error'][:300]})")
        self._begun = True  # (another process's: process 0 wrote the staging marker)
        self.tmp = tempfile.mkdtemp(prefix=f"hybridckpt-spool-{self.token}-p{self.group.index}-")
        interrupts.add_temporary(self.tmp)
        sequential_file.CLOSED.append(self._closed)
        self._redirect = ts_writes.Redirect(self.tmp, self.url, final_folder, self._claim)
        ts_writes.redirect(self._redirect)  # (a compressed import's OCDBT databases: to the bucket)
        return self.tmp

    def _staging(self) -> bytes:
        listed = {n for n in self._planned if n not in self._early}
        return markers.body(listed | self._old, job=self._job, folders=self._folders, trees=[self.tree])

    def _plan(self, name: str) -> None:
        """Objects below the step's tree are listed by it; anything else only process 0 writes and
        lists (another process's would not be listed: refused)."""
        if name.startswith(self.tree):
            self._planned.add(name)
        elif self.primary:
            super()._plan(name)
        else:
            raise CheckpointError(f"{self.dst}: process {self.group.index} would write {name}, outside "
                                  f"{self.tree}; nothing committed")

    def _claim(self, folder: str) -> None:
        """TensorStore is about to write objects directly in `folder` ("a/b/", `io.remote.ts_writes`:
        this process's `ocdbt.process_<i>/` of a compressed import; on process 0 also the items'
        databases its merge writes): below the step's tree it is listed by the staging marker
        already, so only noted (listed at the commit, deleted on a failure); anything else only
        process 0 claims (`RemoteDestination._claim`)."""
        if folder.startswith(self.tree):
            with self._lock:
                self._native.add(folder)
        elif self.primary:
            super()._claim(folder)
        else:
            raise CheckpointError(f"{self.dst}: process {self.group.index} would write {folder}, outside "
                                  f"{self.tree}; nothing committed")

    # -- uploading -------------------------------------------------------------------------------
    def _closed(self, path: str) -> None:
        if self._failed and self.tmp is not None and path.startswith(self.tmp + os.sep):
            try:  # (after a failure nothing more goes up: the spool stays bounded)
                os.remove(path)
            except OSError:
                pass
            return
        super()._closed(path)

    def _guarded(self, step) -> None:
        """Run an upload step; a failure is kept for the agreement (`commit`), not raised: the
        other processes are in the save's collectives, and wait for this one there."""
        try:
            step()
        except Exception as e:
            with self._lock:
                self._failed = True
                if self._error is None:
                    self._error = (str(e) if isinstance(e, HybridCkptError) else
                                   f"{self.dst}: upload failed on process {self.group.index}, nothing "
                                   f"committed: {_reason(e)}")

    # -- closing ---------------------------------------------------------------------------------
    def commit(self) -> None:
        """Upload what is left of this process's spool, agree, commit (steps 2-3 of the module doc)."""
        if not self._failed:
            try:
                byte_source.check_watches()  # after the last read: a source that changed is not committed
            except HybridCkptError as e:
                self._failed, self._error = True, str(e)
        if not self._failed:
            self._guarded(self._upload_rest)
        with self._lock:  # (uploads still running in other threads first)
            while self._inflight:
                self._idle.wait()
        reports = self.group.gather({"error": self._error, "sizes": {} if self._failed else self._sizes})
        failed = [i for i, r in enumerate(reports) if r["error"] is not None]
        if not failed:
            mine = None
            if self.primary:
                try:
                    self._commit_marker([r["sizes"] for r in reports])
                except HybridCkptError as e:
                    mine = str(e)
                except Exception as e:
                    mine = f"{self.dst}: cannot write the commit marker, nothing committed: {_reason(e)}"
                self._error = mine
            reports = self.group.gather({"error": mine})
            failed = [i for i, r in enumerate(reports) if r["error"] is not None]
            if not failed:
                self.committed = self._agreed = True
                return
        self._fail_together(reports, failed)

    def _upload_rest(self) -> None:
        """Process 0: Orbax renamed its temporary folders, upload everything left. Another process:
        its spool's leftovers under the names Orbax's rename gives them on process 0."""
        if self.primary:
            self._check_renamed()
        for spooled in _spooled(self.tmp):
            name = final_name(spooled)
            if ownership.ORBAX_TMP in name:
                raise CheckpointError(f"{self.dst}: {spooled} is in a temporary folder of a layout not known "
                                      f"here; nothing committed")
            self._upload(name, local=os.path.join(self.tmp, *spooled.split("/")))
        for name, size in self._native_objects().items():  # (written by TensorStore: listed too)
            with self._lock:
                self._sizes[name] = size

    def _commit_marker(self, sizes: list[dict[str, int]]) -> None:
        """Process 0: the commit marker listing every process's objects, then the staging marker out."""
        every: dict[str, int] = {}
        for i, theirs in enumerate(sizes):
            for name, size in theirs.items():
                if every.setdefault(name, size) != size:
                    raise CheckpointError(f"{self.dst}: {name} was uploaded by process {i} with {size} bytes and "
                                          f"by another with {every[name]}; nothing committed")
        with interrupts.committing():
            self._written.append(markers.MARKER)
            self._put(markers.MARKER, markers.body(every, sizes=every))
            self.fs.rm_file(self.url.child(markers.STAGING).path)

    def _fail_together(self, reports: list[dict], failed: list[int]) -> None:
        """Every process deletes what it uploaded; process 0 then the staging marker, when every
        process deleted all of its objects; one CheckpointError naming the process that failed."""
        self._failed = True
        left = self._delete_written()
        cleaned = self.group.gather({"left": left})
        if self.primary and not any(r["left"] for r in cleaned):
            try:
                self.fs.rm_file(self.url.child(markers.STAGING).path)
            except Exception:
                pass  # (it stays: the next import with --overwrite removes what it lists)
        self._agreed = True
        first = failed[0]
        if self._error is not None:  # (a process that failed says why; the others name the first that did)
            raise CheckpointError(self._error)
        raise CheckpointError(f"{self.dst}: nothing committed: process {first} failed "
                              f"({str(reports[first]['error'])[:300]})")

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving without the agreement (an error out of the save, a lost peer): this process
        deletes what it uploaded; the staging marker stays (what the others left is not known here)."""
        if self._closed in sequential_file.CLOSED:
            sequential_file.CLOSED.remove(self._closed)
        if self._redirect is not None:
            ts_writes.release(self._redirect)
            self._redirect = None
        if not self._agreed and self._begun:
            self._failed = True
            self._delete_written()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            interrupts.discard_temporary(self.tmp)
            self.tmp = None
