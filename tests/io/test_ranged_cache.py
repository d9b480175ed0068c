"""The process-wide cache of byte ranges fetched from a bucket (`io.remote.ranged._Fetched`) may
be cleared (`ranged.forget`: a job's end, `io.open_files.watch`) while a GET of another thread is
in flight, as when a restore reads from a bucket while an import in the same process ends, or a
failed import's reader tasks still run after its job returned. The fetcher then filled (or failed)
its pieces by looking them up in the cache, found none, and neither it nor the readers waiting
for those bytes were ever woken: reader threads lost for good, the next read of the process hung.
A fake filesystem stands in for the bucket (no server): what is checked is who is woken, with
which bytes."""

from __future__ import annotations

import threading

import pytest

from hybridckpt.errors import CheckpointError
from hybridckpt.io.remote import ranged
from hybridckpt.io.remote.urls import parse

DATA = bytes(range(256)) * 512  # 128 KiB


class _Bucket:
    """An fsspec filesystem's `cat_file` over DATA; `during` runs inside each GET (in flight)."""

    def __init__(self, during=None):
        self.during, self.gets = during, 0

    def cat_file(self, key, start, end):
        self.gets += 1
        if self.during is not None:
            self.during()
        return DATA[start:end]


def _object(fs, name: str) -> ranged.RemoteObject:
    return ranged.RemoteObject(parse(f"s3://b/{name}"), fs, len(DATA), "h")


def test_a_fetch_in_flight_when_the_cache_is_forgotten_is_still_delivered(monkeypatch):
    waits = []
    result = ranged._Piece.result

    def no_blind_wait(piece):  # (one thread here: a piece not filled by now never will be)
        waits.append(piece.done.is_set())
        if not piece.done.is_set():
            piece.done.set()  # (rather than hang: the assertion below names it)
        return result(piece)

    monkeypatch.setattr(ranged._Piece, "result", no_blind_wait)
    obj = _object(_Bucket(during=ranged.forget), "forgotten")  # another job ends during the GET
    got = []
    ranged.read_ranges(obj, [(1000, 3000)], lambda start, view: got.append((start, bytes(view))))
    assert waits == [True]  # (before: False, the fetcher waiting for its own piece, forever)
    ((start, data),) = got
    assert data[1000 - start: 3000 - start] == DATA[1000:3000]
    ranged.read_ranges(obj, [(1000, 3000)], lambda *_: None)  # not kept: fetched again
    assert obj.fs.gets == 2


def test_a_reader_waiting_on_a_fetch_that_fails_after_a_forget_gets_the_error(monkeypatch):
    """A second reader of the same bytes waits for the first one's GET; the cache is cleared, then
    the GET fails: the waiting reader is given the error (before: nobody woke it)."""
    waiting, pieces, errors = threading.Event(), [], []
    result = ranged._Piece.result

    def noted(piece):
        pieces.append(piece)
        waiting.set()
        return result(piece)

    monkeypatch.setattr(ranged._Piece, "result", noted)

    def second_reader():
        try:
            ranged.read_ranges(obj, [(5000, 6000)], lambda *_: None)
        except CheckpointError as e:
            errors.append(e)

    reader = threading.Thread(target=second_reader, daemon=True)

    def in_flight():
        reader.start()
        waiting.wait()  # (the second reader found this GET's piece in flight and waits on it)
        ranged.forget()
        raise FileNotFoundError("gone")  # (not retried: the fetch fails at once)

    obj = _object(_Bucket(during=in_flight), "fails")
    try:
        with pytest.raises(CheckpointError, match="gone"):
            ranged.read_ranges(obj, [(5000, 6000)], lambda *_: None)
        assert pieces[0].done.is_set()  # (before: never set)
    finally:
        for p in pieces:
            p.done.set()  # (the old code: free the reader rather than leave it blocked)
        reader.join()
    assert len(errors) == 1 and "gone" in str(errors[0]) and obj.fs.gets == 1
