"""A raw streaming save does its serial work beside the reads, not before them (issue 42): each
leaf's tiles are planned on the planner thread, never in the event loop that dispatches the
tiles, and the arrays' zarr metadata is created while tiles are already read and written. No
time is measured: the tests count where the planning ran and in what order things happened."""

import asyncio
import threading

from fixtures.store_files import assert_same_chunk_files
from meshes import fit

from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.jobs.import_ import import_checkpoint
from hybridckpt.store import stream, stream_orbax


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_tiles_are_planned_off_the_event_loop(tmp_path, monkeypatch):
    """Planned in the event loop, every leaf's tile plan (a dry read of its first tile) ran one
    after the other before the first tile was read; on the planner thread none does."""
    calls: list[tuple[str, bool]] = []
    real = stream.owned_tiles

    def spy(leaf, *a, **k):
        calls.append((threading.current_thread().name, _on_event_loop()))
        return real(leaf, *a, **k)

    monkeypatch.setattr(stream, "owned_tiles", spy)
    s = import_checkpoint(sample_path(), tmp_path / "ck", mesh=fit("fsdp=2,tp=2"))
    assert len(calls) >= s.tensors  # every array written was planned (and the step counter)
    assert [c for c in calls if c[1]] == []  # none in the event loop
    assert {name for name, _ in calls} == {"hybridckpt-plan_0"}


def test_raw_writes_do_not_wait_for_the_array_metadata(tmp_path, monkeypatch):
    """The `.zarray` of each array is created (TensorStore, `create=True`) while the readers
    already write chunk files: the first create here waits until a tile has been read, which
    before this change never happened (every create came first), so it gave up and said so."""
    real_read, real_ts = stream.read_tile, stream_orbax.ts
    seen = {"tiles": 0, "tiles_before_first_create": None}
    waiting: list = []  # (loop, event) of each create waiting for a tile: several arrays' creates
    # start together, each must be woken (one event, replaced by the next create, left the first
    # waiting out its whole bound: 60 s of every run)

    def read_tile(*a):
        seen["tiles"] += 1
        for loop, ev in list(waiting):
            loop.call_soon_threadsafe(ev.set)
        return real_read(*a)

    class TS:
        def __getattr__(self, name):
            return getattr(real_ts, name)

        @staticmethod
        async def open(*a, create=False, **k):
            if create and seen["tiles_before_first_create"] is None:
                ev = asyncio.Event()
                waiting.append((asyncio.get_running_loop(), ev))
                if not seen["tiles"]:
                    try:  # (bounded: the old order would wait here for ever)
                        await asyncio.wait_for(ev.wait(), 60)
                    except TimeoutError:
                        pass
                if seen["tiles_before_first_create"] is None:
                    seen["tiles_before_first_create"] = seen["tiles"]
            return await real_ts.open(*a, create=create, **k)

    monkeypatch.setattr(stream, "read_tile", read_tile)
    monkeypatch.setattr(stream_orbax, "ts", TS())
    ck = tmp_path / "ck"
    import_checkpoint(sample_path(), ck, mesh=fit("fsdp=2,tp=2"))
    assert seen["tiles_before_first_create"] >= 1
    # the checkpoint is whole: every array file as a plain import writes it, and it verifies
    monkeypatch.undo()
    plain = tmp_path / "plain"
    import_checkpoint(sample_path(), plain, mesh=fit("fsdp=2,tp=2"))
    assert_same_chunk_files(ck, plain)
    assert main(["verify", str(ck)]) == 0
