"""A save that fails in one item returns only once Orbax's own threads of the others have ended
(`store.orbax_io.join_orbax_threads`). Orbax writes each item's `_METADATA` in a thread of its own
once that item's writes are committed; the optimizer item failing ended the save while the params'
thread was still to write, and its `_METADATA` landed after the import had removed its temporary
folder, re-creating it beside the destination (CI: `test_store_s3_spool`'s spool, on a loaded
machine; locally, a thread writing while the folder is removed). Forced here: the params'
`_METADATA` write waits 1 s, the optimizer item fails; the job's error comes after that write."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as pytree_handler

from hybridckpt.demo import sample_path
from hybridckpt.errors import HybridCkptError
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.store import stream_orbax


def test_a_failed_import_leaves_nothing_once_orbax_threads_end(tmp_path, monkeypatch):
    real_metadata = pytree_handler.BasePyTreeCheckpointHandler._write_metadata_file
    real_serialize = stream_orbax.LazyArrayHandler.serialize
    written = []

    async def late_metadata(self, directory, *args, **kwargs):
        time.sleep(1.0)  # (Orbax's thread of the params, behind a loaded machine)
        written.append(str(directory))
        return await real_metadata(self, directory, *args, **kwargs)

    async def failing(self, values, infos, args=None):
        if "opt_state" in str(infos[0].parent_dir):
            await asyncio.sleep(0.5)  # (after the params' writes: their metadata thread started)
            raise OSError("disk gone (injected)")
        return await real_serialize(self, values, infos, args)

    monkeypatch.setattr(pytree_handler.BasePyTreeCheckpointHandler, "_write_metadata_file", late_metadata)
    monkeypatch.setattr(stream_orbax.LazyArrayHandler, "serialize", failing)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises((HybridCkptError, OSError)):
        import_checkpoint(sample_path(), str(out / "ck"), mesh="fsdp=1")
    assert written  # the params' late _METADATA thread had ended when the job returned its error
    time.sleep(1.5)  # (and nothing else of the save lands later)
    assert os.listdir(out) == []
