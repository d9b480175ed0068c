"""The one opcode walk: hostile lengths refused before unpickling, pickle ends and payloads found."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from hybridckpt.containers.pickle.machine import safe_loads
from hybridckpt.containers.pickle.opcodes import FRAME_SIZE, Truncated, check_pickle, scan_pickle
from hybridckpt.errors import FormatError

# -- denial of service -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, match",
    [
        (b"\x80\x04\x8e" + struct.pack("<Q", 1 << 62) + b"abc.", "claims"),  # BINBYTES8
        (b"\x80\x02X" + struct.pack("<I", 1 << 31) + b"abc.", "claims"),  # BINUNICODE
        (b"\x80\x02B" + struct.pack("<I", 100) + b"abc.", "claims"),  # BINBYTES
        (b"\x80\x02\x8b" + struct.pack("<i", -5) + b".", "claims"),  # LONG4 negative
        (b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N.", "frame"),
        (b"\x80\x02]r" + struct.pack("<I", 0xFFFFFFF0) + b".", "memo"),  # LONG_BINPUT
        (b"]p4000000000\n.", "memo"),  # PUT
        (b"\x80\x02}q\x00(X\x01\x00\x00\x00a", "truncated"),
        (b"", "truncated"),
        (b"\x80\x02\xff.", "opcode"),
    ],
)
def test_hostile_lengths_are_format_errors(data, match):
    with pytest.raises(FormatError, match=f"dos.pkl.*{match}|{match}.*dos.pkl"):
        safe_loads(data, what="dos.pkl")


def test_check_pickle_returns_end_of_each_pickle():
    a, b = pickle.dumps([1, 2]), pickle.dumps({"x": b"y" * 300}, protocol=4)
    buf = a + b + b"raw tail"
    assert check_pickle(buf, what="s") == len(a)
    assert check_pickle(buf, len(a), what="s") == len(a) + len(b)


def test_a_cut_pickle_is_truncated_and_a_longer_stream_is_judged_by_its_end():
    data = pickle.dumps({"x": b"y" * 300}, protocol=3)  # no FRAME: the BINBYTES claim is cut
    head = data[:40]
    with pytest.raises(Truncated, match="head.pkl: pickle truncated"):
        check_pickle(head, what="head.pkl", stream_end=len(data))  # a reader may read more
    with pytest.raises(FormatError, match="claims 300 bytes") as e:
        check_pickle(head, what="head.pkl")  # the whole stream: the claim cannot fit
    assert not isinstance(e.value, Truncated)


# -- payloads and frames (Paddle's lazy reader) -------------------------------------------------


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_payloads_are_found_at_their_offsets(protocol):
    big, small = b"\x01" * 5000, b"\x02" * 10
    data = pickle.dumps({"big": big, "small": small, "huge": b"\x03" * 70_000}, protocol=protocol)
    scan = scan_pickle(data, what="p.pkl", payload_min_bytes=4096)
    assert scan.end == len(data)
    found = [bytes(data[off : off + n]) for _, off, n in scan.payloads]
    assert found == [big, b"\x03" * 70_000]
    for op, off, _ in scan.payloads:
        assert data[op] in (ord("B"), 0x8E) and off - op in (5, 9)  # BINBYTES / BINBYTES8
    assert scan_pickle(data, what="p.pkl").payloads == ()  # only when asked


def test_frames_are_found_and_can_be_dropped():
    arr = np.arange(100_000, dtype=np.float32)  # protocol 4 frames the opcodes around it
    data = pickle.dumps({"a": arr, "b": list(range(5000))}, protocol=4)
    scan = scan_pickle(data, what="f.pkl")
    assert scan.frames and all(data[f] == 0x95 for f in scan.frames)
    parts, pos = [], 0
    for f in scan.frames:
        parts.append(data[pos:f])
        pos = f + FRAME_SIZE
    unframed = b"".join(parts) + data[pos:]
    got = safe_loads(unframed, what="f.pkl")
    np.testing.assert_array_equal(got["a"], arr)
    assert got["b"] == list(range(5000))


def test_the_walk_reads_an_mmap(tmp_path):
    import mmap

    path = tmp_path / "m.pkl"
    path.write_bytes(pickle.dumps([b"z" * 8192, "t"], protocol=4))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        scan = scan_pickle(m, what=str(path), payload_min_bytes=4096)
        assert scan.end == len(m) and len(scan.payloads) == 1


def test_a_reader_that_drops_frames_need_not_judge_them():
    data = b"\x80\x04\x95" + struct.pack("<Q", 1 << 40) + b"N."  # the claim is past the end
    with pytest.raises(FormatError, match="frame"):
        scan_pickle(data, what="f.pkl")
    scan = scan_pickle(data, what="f.pkl", judge_frames=False)
    assert scan.frames == (2,) and scan.end == len(data)
