"""A raw streaming save writes each item's `_sharding` record (Orbax's own writer) while its tiles
are read and written, not before the first tile (issue 42, the import's serial start: its JSON
made and committed for every leaf was the longest wait of the save's start with no reader busy).
Counted, not timed: how many tiles were written before the record was; the checkpoint is whole;
a failure of the record stops the save with nothing committed."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from fixtures.store_files import assert_same_chunk_files
from meshes import fit

from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.store import stream_orbax


def test_sharding_record_does_not_hold_back_the_tiles(tmp_path, monkeypatch):
    """Each item's record here waits until a tile has been written, which before this change
    never happened (the record came first), so it gave up and counted none."""
    real_record, real_write = stream_orbax.jax_array_handlers._async_serialize_shardings, stream_orbax._write_tile
    tiles = [0]
    waiting: list = []  # (loop, event) of each record waiting for a tile
    before: list[int] = []  # tiles written when each item's record was written

    def write_tile(*a):
        real_write(*a)
        tiles[0] += 1
        for loop, ev in list(waiting):
            loop.call_soon_threadsafe(ev.set)

    async def record(**kw):
        ev = asyncio.Event()
        waiting.append((asyncio.get_running_loop(), ev))
        if not tiles[0]:
            try:  # (bounded: the old order would wait here for ever)
                await asyncio.wait_for(ev.wait(), 30)
            except TimeoutError:
                pass
        before.append(tiles[0])
        await real_record(**kw)

    monkeypatch.setattr(stream_orbax, "_write_tile", write_tile)
    monkeypatch.setattr(stream_orbax.jax_array_handlers, "_async_serialize_shardings", record)
    ck = tmp_path / "ck"
    s = import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2,tp=2"))
    assert len(before) == 2 and all(n >= 1 for n in before)  # params and opt_state: tiles first
    assert tiles[0] >= s.tensors
    # the record is whole: one entry per array of the item, and the checkpoint as a plain import's
    monkeypatch.undo()
    step = os.path.join(ck, str(s.step))
    for item in ("params", "opt_state"):
        with open(os.path.join(step, item, "_sharding")) as f:
            record_ = json.load(f)
        arrays = [n for n in os.listdir(os.path.join(step, item)) if os.path.isdir(os.path.join(step, item, n))
                  and n != "array_metadatas"]
        assert len(record_) == len(arrays) > 1
    plain = tmp_path / "plain"
    import_checkpoint(sample_path(), plain, mesh=fit("fsdp=2,tp=2"))
    assert_same_chunk_files(ck, plain)
    with open(os.path.join(plain, str(s.step), "params", "_sharding"), "rb") as f, \
            open(os.path.join(step, "params", "_sharding"), "rb") as g:
        assert f.read() == g.read()
    assert main(["verify", str(ck)]) == 0


def test_a_failed_sharding_record_commits_nothing(tmp_path, monkeypatch):
    """The record written beside the tiles still fails the save: one CheckpointError, the
    destination never made, nothing left beside it."""

    async def record(**kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stream_orbax.jax_array_handlers, "_async_serialize_shardings", record)
    with pytest.raises(CheckpointError, match="No space left on device"):
        import_checkpoint(sample_path(), tmp_path / "ck", mesh=fit("fsdp=2,tp=2"))
    assert os.listdir(tmp_path) == []
