"""Damaged checkpoints of every format: the case list shared by tests/formats/test_damaged.py and
benchmarks/reliability.py.

A `Damage` copies one source checkpoint (`attacks.sources`), breaks it in one way, and names
what the error must mention: the file (and the key or field) that is wrong. Kinds of damage:
truncated files; flipped bytes in a zip central directory, a pickle stream, a safetensors
header, DCP metadata and JSON metadata; a missing or extra rank file; shapes that disagree
across ranks; wrong dtypes; overlapping or gappy chunks; a topology in the metadata that
disagrees with the files. Flips inside raw tensor data are not cases: these formats carry no
checksum a reader could check (`hybridckpt verify` covers imported checkpoints).

`diagnose(case, sources, workdir)` opens the damaged copy with its format's reader, reads every
tensor and moment, and returns a `Result`: ok when a project error named everything it should.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

# -- edits ----------------------------------------------------------------------------------------

Edit = Callable[[str], None]  # mutates the copied checkpoint folder in place


def _path(d: str, rel: str) -> str:
    return os.path.join(d, rel)


def truncate(rel: str, keep: float | int) -> Edit:
    """Cut `rel` to a fraction (float) or to its size minus `keep` bytes (negative int) or to
    `keep` bytes (positive int)."""

    def f(d):
        p = _path(d, rel)
        size = os.path.getsize(p)
        n = int(size * keep) if isinstance(keep, float) else (size + keep if keep < 0 else keep)
        os.truncate(p, n)

    return f


def xor_at(rel: str, offset: int | Callable[[bytes], int], mask: int = 0xFF) -> Edit:
    def f(d):
        p = _path(d, rel)
        data = bytearray(open(p, "rb").read())
        i = offset(bytes(data)) if callable(offset) else offset
        data[i] ^= mask
        open(p, "wb").write(bytes(data))

    return f


def replace(rel: str, old: bytes, new: bytes) -> Edit:
    """Replace the first occurrence of `old` (which must be there) by `new`."""

    def f(d):
        p = _path(d, rel)
        data = open(p, "rb").read()
        assert old in data, (rel, old)
        open(p, "wb").write(data.replace(old, new, 1))

    return f


def delete(rel: str) -> Edit:
    def f(d):
        p = _path(d, rel)
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

    return f


def copy(rel: str, new: str) -> Edit:
    def f(d):
        src, dst = _path(d, rel), _path(d, new)
        shutil.copytree(src, dst) if os.path.isdir(src) else shutil.copy(src, dst)

    return f


def edit_json(rel: str, fn: Callable[[dict], None]) -> Edit:
    def f(d):
        p = _path(d, rel)
        with open(p) as fh:
            doc = json.load(fh)
        fn(doc)
        with open(p, "w") as fh:
            json.dump(doc, fh)

    return f


def _torch_load(p: str):
    import torch

    if "megatron" in p:
        from fixtures.megatron_writer import _megatron_enums

        _megatron_enums()
    return torch.load(p, weights_only=False, map_location="cpu")


def edit_torch(rel: str, fn: Callable[[object], object | None]) -> Edit:
    """torch.load (trusted: our own fixture), edit, torch.save."""

    def f(d):
        import torch

        p = _path(d, rel)
        obj = _torch_load(p)
        out = fn(obj)
        torch.save(obj if out is None else out, p)

    return f


def edit_pickle(rel: str, fn: Callable[[object], None]) -> Edit:
    """pickle.load (trusted: our own DCP fixture, torch installed), edit, pickle.dump."""

    def f(d):
        import torch  # noqa: F401 - the DCP classes

        p = _path(d, rel)
        with open(p, "rb") as fh:
            obj = pickle.load(fh)
        fn(obj)
        with open(p, "wb") as fh:
            pickle.dump(obj, fh)

    return f


def edit_safetensors_header(rel: str, fn: Callable[[dict], None]) -> Edit:
    """Rewrite a safetensors header (the data buffer is kept as it is)."""

    def f(d):
        p = _path(d, rel)
        data = open(p, "rb").read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        fn(header)
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        open(p, "wb").write(struct.pack("<Q", len(blob)) + blob + data[8 + n :])

    return f


def then(*edits: Edit) -> Edit:
    def f(d):
        for e in edits:
            e(d)

    return f


# -- zip central directory ------------------------------------------------------------------------

_CD_FIELDS = {  # offset, size inside a central directory record (APPNOTE 4.3.12)
    "signature": (0, 4),
    "method": (10, 2),
    "crc": (16, 4),
    "compressed_size": (20, 4),
    "size": (24, 4),
    "name_length": (28, 2),
    "header_offset": (42, 4),
    "name": (46, 1),
}


def _cd_record(data: bytes, entry_suffix: str) -> int:
    end = data.rfind(b"PK\x05\x06")
    (start,) = struct.unpack_from("<I", data, end + 16)
    pos = start
    while data[pos : pos + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack_from("<HHH", data, pos + 28)
        name = data[pos + 46 : pos + 46 + n].decode()
        if name.endswith(entry_suffix):
            return pos
        pos += 46 + n + m + k
    raise AssertionError(f"no central directory entry *{entry_suffix}")


def zip_cd(rel: str, entry_suffix: str, field: str, delta: int | None = None, at: int = 0) -> Edit:
    """Change one field of the central directory record of the entry ending in `entry_suffix`:
    add `delta` to an integer field, or XOR 0x20 into byte `at` of it."""

    def f(d):
        p = _path(d, rel)
        data = bytearray(open(p, "rb").read())
        rec = _cd_record(bytes(data), entry_suffix)
        off, size = _CD_FIELDS[field]
        if delta is None:
            data[rec + off + at] ^= 0x20
        else:
            fmt = {2: "<H", 4: "<I"}[size]
            (v,) = struct.unpack_from(fmt, data, rec + off)
            struct.pack_into(fmt, data, rec + off, v + delta)
        open(p, "wb").write(bytes(data))

    return f


def zip_eocd(rel: str, delta: int) -> Edit:
    """Move the central directory offset of the end record by `delta` (the zip64 end record
    when there is one, as torch writes: readers take the offset from it)."""

    def f(d):
        p = _path(d, rel)
        data = bytearray(open(p, "rb").read())
        end64 = data.rfind(b"PK\x06\x06")
        at, fmt = (end64 + 48, "<Q") if end64 >= 0 else (data.rfind(b"PK\x05\x06") + 16, "<I")
        (v,) = struct.unpack_from(fmt, data, at)
        struct.pack_into(fmt, data, at, v + delta)
        open(p, "wb").write(bytes(data))

    return f


def opcode(names: tuple[str, ...], nth: int = 0, byte: int = 1) -> Callable[[bytes], int]:
    """Offset finder for `xor_at` in a raw pickle file: byte `byte` of the `nth` opcode named
    one of `names` (byte 1 is the first byte of its argument, e.g. a length field)."""

    def find(data: bytes) -> int:
        import pickletools

        hits = [pos for op, _arg, pos in pickletools.genops(data) if op.name in names]
        return hits[nth] + byte

    return find


def pickle_of(rel: str) -> Callable[[bytes], int]:
    """Offset finder: the byte just before the STOP of a zip entry `rel`'s data.pkl (opcode
    damage at the end of the stream), used with `xor_at`."""

    def find(data: bytes) -> int:
        with zipfile.ZipFile(__import__("io").BytesIO(data)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
        (n, m) = struct.unpack_from("<HH", data, info.header_offset + 26)
        start = info.header_offset + 30 + n + m
        return start + info.file_size // 2

    return find


# -- cases ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Damage:
    """`source` copied, `edit` applied; opening it as `format` must raise a project error whose
    message contains every string in `names` (a file name, a key)."""

    format: str
    source: str
    name: str
    kind: str
    edit: Edit
    names: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.format}:{self.name}"


def _d(fmt, source, name, kind, edit, *names) -> Damage:
    return Damage(fmt, source, name, kind, edit, tuple(names))


# names used below
MEG = "iter_0000120"
R00, R01 = f"{MEG}/mp_rank_00_000/model_optim_rng.pt", f"{MEG}/mp_rank_01_000/model_optim_rng.pt"
R11 = f"{MEG}/mp_rank_01_001/model_optim_rng.pt"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
DS = "global_step3"
DS_O1 = f"{DS}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
DS_O2 = f"{DS}/zero_pp_rank_2_mp_rank_00_optim_states.pt"
DS_M = f"{DS}/mp_rank_00_model_states.pt"
EMBED = "model.model.embed_tokens.weight"
COL1 = "pytorch_model-meta-dist-00001.json"  # .bin weights: `.json` metadata, as ColossalAI writes it
GATE = "model.layers.0.mlp.gate_proj.weight"


def _megatron_meta(obj, **changes):
    for k, v in changes.items():
        setattr(obj["args"], k, v)


def _meg_tensor(fn):
    def edit(obj):
        obj["model"][QKV] = fn(obj["model"][QKV])

    return edit


def _dcp_chunks(fqn, fn):
    def edit(md):
        fn(md, md.state_dict_metadata[fqn].chunks)

    return edit


def _dcp_move_chunk(fqn: str, old_row: int, new_row: int):
    """Give the chunk at `old_row` the offsets `(new_row, 0)` (and its storage entry too)."""

    def edit(md):
        import torch

        chunks = md.state_dict_metadata[fqn].chunks
        i = next(i for i, c in enumerate(chunks) if c.offsets[0] == old_row)
        old, new = chunks[i].offsets, torch.Size([new_row, 0])
        chunks[i].offsets = new
        for idx in list(md.storage_data):
            if idx.fqn == fqn and tuple(idx.offset) == tuple(old):
                md.storage_data[type(idx)(fqn, new, idx.index)] = md.storage_data.pop(idx)

    return edit


def _dcp_storage(fqn: str, row: int, **changes):
    def edit(md):
        import dataclasses

        for idx, info in list(md.storage_data.items()):
            if idx.fqn == fqn and idx.offset is not None and idx.offset[0] == row:
                md.storage_data[idx] = dataclasses.replace(info, **changes)

    return edit


def _dcp_dtype(fqn: str, dtype_name: str):
    def edit(md):
        import dataclasses

        import torch

        e = md.state_dict_metadata[fqn]
        e.properties = dataclasses.replace(e.properties, dtype=getattr(torch, dtype_name))

    return edit


def _dcp_size(fqn: str, size):
    def edit(md):
        import torch

        md.state_dict_metadata[fqn].size = torch.Size(size)

    return edit


def _ds_osd(fn):
    def edit(obj):
        fn(obj["optimizer_state_dict"])

    return edit


def _set(key, value):
    def fn(d):
        d[key] = value

    return fn


def _col_entry(name, **changes):
    def fn(doc):
        doc["metadata"][name].update(changes)

    return fn


def _paddle_tensor(key, fn):
    """Rewrite one array of a paddle.save state dict file (our own fixture: trusted pickle)."""

    def edit(d):
        p = d
        with open(p, "rb") as fh:
            obj = pickle.load(fh)
        obj[key] = fn(obj[key])
        with open(p, "wb") as fh:
            pickle.dump(obj, fh, protocol=4)

    return edit


def paddle_edit(rel: str, key: str, fn) -> Edit:
    return lambda d: _paddle_tensor(key, fn)(_path(d, rel))


def _half(x):
    import numpy as np

    return x.astype(np.float16)


def _drop_row(x):
    return x[:-1]


def _torch_half(t):
    return t.half()


def _torch_drop_row(t):
    return t[:-1].clone()


CASES: tuple[Damage, ...] = (
    # -- HF safetensors ---------------------------------------------------------------------------
    _d("hf", "hf", "truncated model.safetensors", "truncated", truncate("model.safetensors", 0.5), "model.safetensors"),
    _d("hf", "hf", "truncated inside the header", "truncated", truncate("model.safetensors", 40), "model.safetensors"),
    _d("hf", "hf", "header length flipped", "header", xor_at("model.safetensors", 1, 0x01), "model.safetensors"),
    _d("hf", "hf", "header JSON byte flipped", "header", xor_at("model.safetensors", 8, 0x20), "model.safetensors"),
    _d("hf", "hf", "dtype F32 -> F16 in the header", "dtype",
       edit_safetensors_header("model.safetensors", lambda h: h["model.norm.weight"].update(dtype="F16")),
       "model.safetensors", "model.norm.weight"),
    _d("hf", "hf", "shape digit changed in the header", "header",
       edit_safetensors_header("model.safetensors", lambda h: h["model.norm.weight"].update(shape=[65])),
       "model.safetensors", "model.norm.weight"),
    _d("hf", "hf", "overlapping data_offsets", "header",
       edit_safetensors_header("model.safetensors", lambda h: h["model.norm.weight"].update(
           data_offsets=[h["lm_head.weight"]["data_offsets"][0], h["lm_head.weight"]["data_offsets"][0] + 256])),
       "model.safetensors", "overlap"),
    _d("hf", "hf", "truncated optimizer.safetensors", "truncated", truncate("optimizer.safetensors", 0.7), "optimizer.safetensors"),
    _d("hf", "hf", "config.json byte flipped", "json", xor_at("config.json", 0, 0x20), "config.json"),
    _d("hf", "hf", "hybridckpt.json truncated", "json", truncate("hybridckpt.json", -3), "hybridckpt.json"),
    _d("hf", "hf_sharded", "index JSON byte flipped", "json", xor_at("model.safetensors.index.json", 0, 0x20),
       "model.safetensors.index.json"),
    _d("hf", "hf_sharded", "missing shard file", "missing", delete("model-00002-of-00005.safetensors"),
       "model-00002-of-00005.safetensors"),
    _d("hf", "hf_sharded", "index names a file outside the folder", "json",
       then(copy("model-00001-of-00005.safetensors", "../outside.safetensors"),
            lambda d: edit_json("model.safetensors.index.json", lambda j: j["weight_map"].update(
                {k: "../outside.safetensors" for k, v in j["weight_map"].items() if v == "model-00001-of-00005.safetensors"}))(d)),
       "model.safetensors.index.json", "../outside.safetensors"),
    _d("hf", "hf_sharded", "index file name not a string", "json",
       edit_json("model.safetensors.index.json", lambda j: j["weight_map"].update({"model.norm.weight": 3})),
       "model.safetensors.index.json", "weight_map"),
    _d("hf", "hf_sharded", "tensor in a file but not in the index", "extra",
       edit_json("model.safetensors.index.json", lambda j: j["weight_map"].pop("model.norm.weight")),
       "model.safetensors.index.json", "model.norm.weight"),
    # -- Megatron -----------------------------------------------------------------------------------
    _d("megatron", "megatron", "missing rank folder", "missing", delete(f"{MEG}/mp_rank_01_001"), "mp_rank_01_001"),
    _d("megatron", "megatron", "extra rank folder", "extra", copy(f"{MEG}/mp_rank_01_001", f"{MEG}/mp_rank_02_001"),
       "mp_rank_02_001"),
    _d("megatron", "megatron", "truncated rank file", "truncated", truncate(R11, 0.6), "mp_rank_01_001/model_optim_rng.pt"),
    _d("megatron", "megatron", "zip central directory: data.pkl name", "zip", zip_cd(R11, "/data.pkl", "name", at=3 + len("model_optim_rng/")),
       "mp_rank_01_001/model_optim_rng.pt", "data.pkl"),
    _d("megatron", "megatron", "zip central directory: storage header offset", "zip",
       zip_cd(R11, "/data/0", "header_offset", delta=7), "mp_rank_01_001/model_optim_rng.pt", "data/0"),
    _d("megatron", "megatron", "zip central directory: data.pkl compressed", "zip",
       zip_cd(R11, "/data.pkl", "method", delta=8), "mp_rank_01_001/model_optim_rng.pt", "data.pkl"),
    _d("megatron", "megatron", "zip central directory: signature", "zip", zip_cd(R11, "/data.pkl", "signature", at=2),
       "mp_rank_01_001/model_optim_rng.pt"),
    _d("megatron", "megatron", "zip end record: directory offset", "zip", zip_eocd(R11, 5), "mp_rank_01_001/model_optim_rng.pt"),
    _d("megatron", "megatron", "pickle byte flipped (CRC)", "pickle", xor_at(R11, pickle_of(R11), 0x01),
       "mp_rank_01_001/model_optim_rng.pt", "data.pkl"),
    _d("megatron", "megatron", "shape differs on tp rank 1", "shape", edit_torch(R01, _meg_tensor(_torch_drop_row)),
       "mp_rank_01_000/model_optim_rng.pt", QKV),
    _d("megatron", "megatron", "dtype differs on tp rank 1", "dtype", edit_torch(R01, _meg_tensor(_torch_half)),
       "mp_rank_01_000/model_optim_rng.pt", QKV),
    _d("megatron", "megatron", "key missing on tp rank 1", "shape",
       edit_torch(R01, lambda o: [o["model"].pop(QKV)] and None), "mp_rank_01_000/model_optim_rng.pt", QKV),
    _d("megatron", "megatron", "args say tp=4", "topology",
       edit_torch(R00, lambda o: _megatron_meta(o, tensor_model_parallel_size=4)), "mp_rank_02_000"),
    _d("megatron", "megatron", "args say pp=3", "topology",
       edit_torch(R00, lambda o: _megatron_meta(o, pipeline_model_parallel_size=3)), "mp_rank_00_002"),
    _d("megatron", "megatron", "tracker names a missing iteration", "topology",
       lambda d: open(_path(d, "latest_checkpointed_iteration.txt"), "w").write("130"), "iter_0000130"),
    _d("megatron", "megatron", "tracker is not a number", "json",
       lambda d: open(_path(d, "latest_checkpointed_iteration.txt"), "w").write("12O"), "latest_checkpointed_iteration.txt"),
    # -- Meta Llama -----------------------------------------------------------------------------
    _d("meta-llama", "meta", "missing first shard", "missing", delete("consolidated.00.pth"), "consolidated.00.pth"),
    _d("meta-llama", "meta", "extra shard", "extra", copy("consolidated.01.pth", "consolidated.02.pth"), "consolidated.0"),
    _d("meta-llama", "meta", "truncated shard", "truncated", truncate("consolidated.01.pth", 0.5), "consolidated.01.pth"),
    _d("meta-llama", "meta", "zip central directory: storage name", "zip",
       zip_cd("consolidated.01.pth", "/data/0", "name", at=len("consolidated.01/data/")), "consolidated.01.pth"),
    _d("meta-llama", "meta", "shape differs on rank 1", "shape",
       edit_torch("consolidated.01.pth", lambda o: o.update({"layers.0.attention.wq.weight": o["layers.0.attention.wq.weight"][:-1].clone()})),
       "consolidated.01.pth", "layers.0.attention.wq.weight"),
    _d("meta-llama", "meta", "dtype differs on rank 1", "dtype",
       edit_torch("consolidated.01.pth", lambda o: o.update({"layers.0.attention.wq.weight": o["layers.0.attention.wq.weight"].half()})),
       "consolidated.01.pth", "layers.0.attention.wq.weight"),
    _d("meta-llama", "meta", "key missing on rank 1", "shape",
       edit_torch("consolidated.01.pth", lambda o: [o.pop("layers.0.attention.wq.weight")] and None),
       "consolidated.01.pth", "layers.0.attention.wq.weight"),
    _d("meta-llama", "meta", "params.json byte flipped", "json", xor_at("params.json", 0, 0x20), "params.json"),
    _d("meta-llama", "meta", "params.json dim disagrees with the shards", "topology",
       edit_json("params.json", _set("dim", 48)), "tok_embeddings.weight", "dim=48"),
    # -- DCP ------------------------------------------------------------------------------------
    _d("dcp", "dcp", "truncated .distcp", "truncated", truncate("__1_0.distcp", 0.5), "__1_0.distcp"),
    _d("dcp", "dcp", "missing .distcp", "missing", delete("__2_0.distcp"), "__2_0.distcp"),
    _d("dcp", "dcp", "truncated .metadata", "truncated", truncate(".metadata", 0.5), ".metadata"),
    _d("dcp", "dcp", ".metadata field name flipped", "metadata",
       replace(".metadata", b"state_dict_metadata", b"state_dict_metadatb"), ".metadata", "state_dict_metadata"),
    _d("dcp", "dcp", ".metadata opcode flipped", "metadata", xor_at(".metadata", -1, 0x01), ".metadata"),
    _d("dcp", "dcp", "overlapping chunks", "chunks", edit_pickle(".metadata", _dcp_move_chunk(EMBED, 8, 7)),
       ".metadata", EMBED, "overlap"),
    _d("dcp", "dcp", "gap between chunks", "chunks",
       edit_pickle(".metadata", _dcp_chunks(EMBED, lambda md, ch: ch.pop(2))), ".metadata", EMBED, "gap"),
    _d("dcp", "dcp", "chunk past the global shape", "chunks", edit_pickle(".metadata", _dcp_size(EMBED, (28, 16))),
       ".metadata", EMBED),
    _d("dcp", "dcp", "dtype in metadata disagrees with the chunk", "dtype",
       edit_pickle(".metadata", _dcp_dtype(EMBED, "float16")), "__0_0.distcp", EMBED, "float16"),
    _d("dcp", "dcp", "chunk bytes past the end of the file", "metadata",
       edit_pickle(".metadata", _dcp_storage(EMBED, 8, length=10**7)), "__1_0.distcp", EMBED),
    _d("dcp", "dcp", "storage path outside the folder", "metadata",
       edit_pickle(".metadata", _dcp_storage(EMBED, 8, relative_path="../__1_0.distcp")), ".metadata", EMBED),
    _d("dcp", "dcp", "chunk archive: zip central directory flipped", "zip",
       lambda d: xor_at("__1_0.distcp", lambda data: data.find(b"PK\x01\x02") + 46 + 3, 0x20)(d), "__1_0.distcp"),
    _d("dcp", "dcp_local", "missing rank-local metadata", "missing", delete("__3.metadata"), "rank-local", EMBED, "gap"),
    _d("dcp", "dcp_local", "shape disagrees across rank-local metadata", "shape",
       edit_pickle("__1.metadata", _dcp_size(EMBED, (31, 16))), "__1.metadata", EMBED),
    # -- DeepSpeed -----------------------------------------------------------------------------------
    _d("deepspeed", "deepspeed", "missing optim rank file", "missing", delete(DS_O1), "global_step3", "dp ranks [0, 2]"),
    _d("deepspeed", "deepspeed", "extra optim rank file", "extra",
       copy(DS_O2, f"{DS}/zero_pp_rank_3_mp_rank_00_optim_states.pt"), "partition_count"),
    _d("deepspeed", "deepspeed", "truncated optim file", "truncated", truncate(DS_O1, 0.5), "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    _d("deepspeed", "deepspeed", "zip central directory: data.pkl size", "zip", zip_cd(DS_O1, "/data.pkl", "size", delta=3),
       "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    _d("deepspeed", "deepspeed", "param_shapes disagree with the partitions", "shape",
       edit_torch(DS_M, lambda o: o["param_shapes"][0].update({"fc1.weight": (14, 10)})),
       "mp_rank_00_model_states.pt", "param_shapes"),
    _d("deepspeed", "deepspeed", "zero_stage disagrees across ranks", "topology",
       edit_torch(DS_O1, _ds_osd(_set("zero_stage", 1))), "zero_stage"),
    _d("deepspeed", "deepspeed", "partition_count disagrees with the files", "topology",
       edit_torch(DS_O1, _ds_osd(_set("partition_count", 4))), "zero_pp_rank_1_mp_rank_00_optim_states.pt", "partition_count"),
    _d("deepspeed", "deepspeed", "exp_avg dtype differs on rank 1", "dtype",
       edit_torch(DS_O1, _ds_osd(lambda o: o["base_optimizer_state"]["state"][0].update(
           exp_avg=o["base_optimizer_state"]["state"][0]["exp_avg"].half()))),
       "zero_pp_rank_1_mp_rank_00_optim_states.pt", "exp_avg"),
    _d("deepspeed", "deepspeed", "latest names a missing tag", "topology",
       lambda d: open(_path(d, "latest"), "w").write("global_step9"), "latest", "global_step9"),
    _d("deepspeed", "deepspeed", "missing model states file", "missing", delete(DS_M), "global_step3", "_model_states.pt"),
    _d("deepspeed", "deepspeed", "group_paddings for another group count", "topology",
       edit_torch(DS_O1, _ds_osd(_set("group_paddings", [0]))), "zero_pp_rank_1_mp_rank_00_optim_states.pt", "group_paddings"),
    # -- PaddleNLP ------------------------------------------------------------------------------
    _d("paddle", "paddle", "missing optimizer shard file", "missing", delete("optimizer.tp01_shard01.pdopt"),
       "optimizer.tp01_shard01.pdopt"),
    _d("paddle", "paddle", "missing model_state file", "missing", delete("model_state.tp01.pdparams"),
       "model_state.tp01.pdparams"),
    _d("paddle", "paddle", "extra tp rank file", "extra", copy("model_state.tp01.pdparams", "model_state.tp02.pdparams"),
       "optimizer.tp02_shard00.pdopt"),
    _d("paddle", "paddle", "truncated .pdparams", "truncated", truncate("model_state.tp01.pdparams", 0.5),
       "model_state.tp01.pdparams"),
    _d("paddle", "paddle", "truncated .pdopt", "truncated", truncate("optimizer.tp00_shard01.pdopt", 0.5),
       "optimizer.tp00_shard01.pdopt"),
    _d("paddle", "paddle", "pickle length field flipped", "pickle",
       xor_at("model_state.tp01.pdparams", opcode(("BINBYTES8", "BINBYTES", "SHORT_BINBYTES")), 0x01),
       "model_state.tp01.pdparams"),
    _d("paddle", "paddle", "shape differs on tp rank 1", "shape",
       paddle_edit("model_state.tp01.pdparams", "llama.layers.0.self_attn.q_proj.weight", _drop_row),
       "tp01", "llama.layers.0.self_attn.q_proj.weight"),
    _d("paddle", "paddle", "shape differs on tp rank 1 in model and moments", "shape",
       then(paddle_edit("model_state.tp01.pdparams", "llama.layers.0.self_attn.q_proj.weight", _drop_row),
            paddle_edit("optimizer.tp01_shard01.pdopt", "column_parallel_linear_0.w_0_moment1_0", _drop_row),
            paddle_edit("optimizer.tp01_shard01.pdopt", "column_parallel_linear_0.w_0_moment2_0", _drop_row)),
       "model_state.tp01.pdparams", "llama.layers.0.self_attn.q_proj.weight"),
    _d("paddle", "paddle", "moment dtype differs on tp rank 1", "dtype",
       paddle_edit("optimizer.tp01_shard01.pdopt", "column_parallel_linear_0.w_0_moment1_0", _half),
       "optimizer.tp01_shard01.pdopt", "llama.layers.0.self_attn.q_proj.weight"),
    _d("paddle", "paddle", "config.json byte flipped", "json", xor_at("config.json", 0, 0x20), "config.json"),
    _d("paddle", "paddle", "trainer_state.json truncated", "json", truncate("trainer_state.json", -4), "trainer_state.json"),
    _d("paddle", "paddle", "model_meta.json says tp 4", "topology",
       lambda d: json.dump({"parallel_config": {"mp_degree": 4, "pp_degree": 1, "sharding_degree": 2}},
                           open(_path(d, "model_meta.json"), "w")), "optimizer.tp02_shard00.pdopt"),
    _d("paddle", "paddle", "model_meta.json with wrong types", "json",
       lambda d: json.dump({"parallel_config": [4], "sharding_metas": []}, open(_path(d, "model_meta.json"), "w")),
       "model_meta.json", "parallel_config"),
    _d("paddle-unified", "paddle_unified", "index JSON byte flipped", "json",
       xor_at("model.safetensors.index.json", 0, 0x20), "model.safetensors.index.json"),
    _d("paddle-unified", "paddle_unified", "missing shard", "missing", delete("model-00002-of-00002.safetensors"),
       "model-00002-of-00002.safetensors"),
    _d("paddle-unified", "paddle_unified", "safetensors header flipped", "header",
       xor_at("optimizer-00001-of-00002.safetensors", 8, 0x20), "optimizer-00001-of-00002.safetensors"),
    _d("paddle-unified", "paddle_unified", "index names a file outside the folder", "json",
       edit_json("model.safetensors.index.json",
                 lambda j: j["weight_map"].update({"llama.norm.weight": "/etc/model-00001-of-00002.safetensors"})),
       "model.safetensors.index.json", "llama.norm.weight"),
    # -- ColossalAI -----------------------------------------------------------------------------
    _d("colossal", "colossal", "missing weight file", "missing", delete("pytorch_model-dist-00001-shard-00002.bin"),
       "pytorch_model-dist-00001-shard-00002.bin"),
    _d("colossal", "colossal", "metadata JSON byte flipped", "json", xor_at(COL1, 0, 0x20), COL1),
    _d("colossal", "colossal", "overlapping pieces", "chunks", edit_json(COL1, _col_entry(GATE, offsets=[10, 0])), GATE, "overlap"),
    _d("colossal", "colossal", "gap between pieces", "chunks", edit_json(COL1, _col_entry(GATE, offsets=[13, 0], lengths=[11, 16])),
       GATE, "gap"),
    _d("colossal", "colossal", "global_shape disagrees across ranks", "shape",
       edit_json(COL1, _col_entry(GATE, global_shape=[25, 16])), COL1, GATE),
    _d("colossal", "colossal", "lengths with the wrong rank", "shape", edit_json(COL1, _col_entry(GATE, lengths=[12])), COL1, GATE),
    _d("colossal", "colossal", "lengths larger than the stored tensor", "shape",
       edit_json(COL1, _col_entry(GATE, lengths=[13, 16], offsets=[11, 0])), GATE),
    _d("colossal", "colossal", "dtype differs on rank 1", "dtype",
       edit_torch("pytorch_model-dist-00001-shard-00002.bin", lambda o: {k: v.half() for k, v in o.items()}),
       "pieces have different dtypes", "pytorch_model-dist-00001-shard-00002.bin"),
    _d("colossal", "colossal", "truncated weight file", "truncated", truncate("pytorch_model-dist-00001-shard-00002.bin", 0.5),
       "pytorch_model-dist-00001-shard-00002.bin"),
    _d("colossal", "colossal", "missing rank metadata", "missing", delete(COL1), "model.embed_tokens.weight", "gap"),
)


# -- diagnosis ------------------------------------------------------------------------------------


@dataclass
class Result:
    id: str
    format: str
    kind: str
    error: str
    message: str
    ok: bool
    why: str = ""
    path: str = ""


def prepare(case: Damage, sources: dict[str, str], workdir: str) -> str:
    """A damaged copy of the case's source; returns its folder."""
    os.makedirs(workdir, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", case.id)[:60]
    dst = os.path.join(tempfile.mkdtemp(prefix=f"{slug}-", dir=workdir), case.source)
    shutil.copytree(sources[case.source], dst)
    case.edit(dst)
    return dst


def read_everything(path: str, fmt: str) -> None:
    """Open `path` as `fmt` and read every tensor, moment and master weight."""
    from hybridckpt.formats.registry import open_source
    from hybridckpt.io.byte_source import close_all

    try:
        src = open_source(path, fmt)
        tensors = list(src.tensors.values())
        if src.optimizer is not None:
            o = src.optimizer
            tensors += [t for s in o.slots.values() for t in s.values()] + list(o.master.values())
        for t in tensors:
            t.materialize()
    finally:
        close_all()


def judge(case: Damage, error: BaseException | None, path: str = "") -> Result:
    from hybridckpt.errors import HybridCkptError

    msg = " ".join(str(error).split()) if error is not None else ""
    why = ""
    if error is None:
        why = "read without an error"
    elif not isinstance(error, HybridCkptError):
        why = f"escaped as {type(error).__name__}"
    else:
        missing = [n for n in case.names if n not in msg]
        if missing:
            why = f"message does not name {missing}"
    return Result(case.id, case.format, case.kind, type(error).__name__ if error else "", msg[:500], not why, why, path)


def diagnose(case: Damage, sources: dict[str, str], workdir: str) -> Result:
    path = prepare(case, sources, workdir)
    err = None
    try:
        read_everything(path, case.format)
    except Exception as e:  # noqa: BLE001 - judged
        err = e
    return judge(case, err, path)


def formats() -> list[str]:
    return list(dict.fromkeys(c.format for c in CASES))


assert len({c.id for c in CASES}) == len(CASES)


def cli_check(case: Damage, path: str, dst: str) -> str:
    """Run the CLI on a damaged copy: '' when it exits 2 with one line naming everything in
    `case.names` and writes nothing at `dst`, else why not. Deepspeed sources carry no model
    config, so `inspect` there (every deepspeed case is found when the folder is opened);
    `import` elsewhere."""
    import contextlib
    import io

    from hybridckpt.cli import main
    from hybridckpt.io.byte_source import close_all

    if case.format == "deepspeed":
        argv = ["inspect", path, "--format", case.format]
    else:
        argv = ["import", path, dst, "--format", case.format, "--quiet"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    close_all()
    text = err.getvalue()
    parent, name = os.path.dirname(dst), os.path.basename(dst)
    if code != 2:
        return f"exit {code}: {text[-300:]}"
    if not text.startswith("hybridckpt: error:") or text.count("\n") != 1:
        return f"not one line: {text[:300]!r}"
    missing = [n for n in case.names if n not in text]
    if missing:
        return f"CLI message does not name {missing}"
    if os.path.exists(dst) or any(p.startswith(f".{name}.") for p in os.listdir(parent)):
        return "the CLI wrote something"
    return ""
