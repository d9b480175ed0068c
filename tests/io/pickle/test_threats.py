"""A refused pickle that names a global no checkpoint may use says so first, even when it is
refused for being malformed before the unpickler would reach that global (payloads injected at
the start of `data.pkl`)."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.pickle.machine import safe_loads
from hybridckpt.containers.pickle.opcodes import scan_pickle
from hybridckpt.errors import FormatError, UnsafePickleError


def _torch_zip(tmp_path, rewrite) -> str:
    """torch.save of a small state dict with its `data.pkl` passed through `rewrite`."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = rewrite(data)
            out.writestr(info, data)
    return str(path)


# GLOBAL os.system, a command, call it, drop the result: the classic injected prologue; then a
# memo index no pickle could have (the walk refuses it as malformed before any unpickling)
INJECTED = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00idR0r\xff\xff\x00\x00"


def test_injected_payload_is_named_before_the_malformation(tmp_path):
    path = _torch_zip(tmp_path, lambda data: INJECTED + data)
    with pytest.raises(UnsafePickleError) as e:
        torch_save.load(path)
    msg = str(e.value)
    assert "refers to global 'os.system'" in msg and "refused without running it" in msg
    assert msg.index("os.system") < msg.index("memo index")  # the threat first, then the defect


def test_the_walk_names_globals_of_every_protocol_without_running_them():
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("echo pwned",))

    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps({"a": [1, 2], "b": Evil()}, protocol=proto)
        assert scan_pickle(data, what="x").globals[-1][1] == "system", proto
        with pytest.raises(UnsafePickleError, match="system"):
            safe_loads(data, what="x")


def test_a_malformed_pickle_naming_only_allowed_globals_stays_a_format_error(tmp_path):
    ok = b"\x80\x02ccollections\nOrderedDict\n)Rr\xff\xff\x00\x00"
    with pytest.raises(FormatError) as e:
        safe_loads(ok, what="x")
    assert not isinstance(e.value, UnsafePickleError) and "memo index" in str(e.value)
