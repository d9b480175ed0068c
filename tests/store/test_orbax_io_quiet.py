"""The one-line contract on a full disk: asyncio's log of the sibling writes' unretrieved
exceptions (`store.orbax_io._FullDiskSiblings`) is dropped; any other unretrieved exception is
still logged (CI saw `test_crash_safety`'s `maxtext-16k` print one now and then)."""

from __future__ import annotations

import asyncio
import gc

from hybridckpt.store import orbax_io  # noqa: F401  (installs the filter)


def _unretrieved(text: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        f = loop.create_future()
        f.set_exception(ValueError(text))
        del f
        gc.collect()
    finally:
        loop.close()


def test_only_a_full_disks_unretrieved_errors_are_dropped(caplog):
    _unretrieved('RESOURCE_EXHAUSTED: Failed to write 13 bytes to file 16: No space left on device')
    _unretrieved("something else broke")
    logged = [f"{r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in caplog.records if r.name == "asyncio"]
    assert [m for m in logged if "No space left" in m] == []
    assert any("something else broke" in m for m in logged), logged
