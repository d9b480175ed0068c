"""Files of every kind hybridckpt unpickles, with a payload fragment planted inside.

Each container writes a file (or a folder) that is valid around the payload and returns
`(path to open, the file the error must name)`; `open_path` opens it the way a user would
(through format detection for folders) and reads every tensor. With a harmless fragment the
planted file unpickles (`load_file`; tests/test_attacks.py
`test_containers_are_valid_around_the_payload`), so a refusal is the payload's doing.

The pickles are written opcode by opcode (`opcodes`); storages are named by persistent ids in
the container's own form (zip: `('storage', T, key, 'cpu', numel)`, legacy: 6-tuples with a
view), so a payload can aim at a storage's size, offset and stride.
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from attacks import opcodes as op

LLAMA_CONFIG = {  # a tiny HF Llama config.json (the paddle container needs one)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": 16,
    "max_position_embeddings": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
STORAGE_BYTES = b"".join(struct.pack("<f", float(i)) for i in range(4))  # storage '0': 4 floats


class Ctx:
    """What a payload builder may use: the marker path it tries to create, and persistent ids in
    the container's form (`storage(...)` returns the opcodes pushing a storage object)."""

    def __init__(self, marker: str, legacy: bool = False):
        self.marker = marker
        self.legacy = legacy

    def storage(self, key: str = "0", stype: str = "FloatStorage", numel: int = 4) -> bytes:
        fields = [op.text("storage"), op.glob("torch", stype), op.text(key), op.text("cpu"), op.integer(numel)]
        if self.legacy:
            fields.append(op.NONE)
        return op.tup(*fields) + b"Q"  # BINPERSID

    def tensor(self, storage: bytes | None = None, offset: int = 0, size=(4,), stride=(1,)) -> bytes:
        """`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`."""
        return op.call(
            op.glob("torch._utils", "_rebuild_tensor_v2"),
            self.storage() if storage is None else storage,
            op.integer(offset),
            op.value(tuple(size)),
            op.value(tuple(stride)),
            op.FALSE,
            op.call(op.glob("collections", "OrderedDict")),
        )


# -- torch.save writers ---------------------------------------------------------------------


def torch_zip(path: str, data_pkl: bytes, storages: dict[str, bytes] | None = None) -> None:
    """A torch.save zip archive (STORED entries under `archive/`) around `data_pkl`."""
    storages = {"0": STORAGE_BYTES} if storages is None else storages
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", b"little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", b"3\n")


def torch_legacy(path: str, obj_pkl: bytes, storages: dict[str, tuple[int, bytes]] | None = None) -> None:
    """A legacy (pre-1.6) torch.save file: magic, protocol, sys_info, `obj_pkl`, storage keys,
    then per key an int64 element count and the bytes."""
    storages = {"0": (4, STORAGE_BYTES)} if storages is None else storages
    head = [
        op.stream(op.integer(0x1950A86A20F9469CFC6C)),
        op.stream(op.integer(1001)),
        op.stream(op.dct({"protocol_version": op.integer(1001), "little_endian": op.TRUE,
                          "type_sizes": op.dct({"short": op.integer(2), "int": op.integer(4), "long": op.integer(4)})})),
        obj_pkl,
        op.stream(op.lst(*(op.text(k) for k in storages))),
    ]
    with open(path, "wb") as f:
        f.write(b"".join(head))
        for numel, data in storages.values():
            f.write(struct.pack("<q", numel) + data)


def state_with(ctx: Ctx, evil: bytes, *, tensor: bool = True) -> bytes:
    """`{'w': <a real tensor on storage '0'>, 'evil': <payload>}` as a whole pickle."""
    items = {"w": ctx.tensor()} if tensor else {}
    items["evil"] = evil
    return op.stream(op.dct(items))


# -- containers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    """A kind of file hybridckpt unpickles. `write(folder, fragment_builder)` plants the payload
    and returns (path to open, file the error must name); `torch` whether storages exist."""

    name: str
    write: Callable[[str, Callable[[Ctx], bytes], str], tuple[str, str]]
    torch: bool
    describe: str


def _torch_zip(folder: str, build, marker: str) -> tuple[str, str]:
    path = os.path.join(folder, "model.pt")
    ctx = Ctx(marker)
    torch_zip(path, state_with(ctx, build(ctx)))
    return path, path


def _torch_legacy(folder: str, build, marker: str) -> tuple[str, str]:
    path = os.path.join(folder, "legacy.pt")
    ctx = Ctx(marker, legacy=True)
    torch_legacy(path, state_with(ctx, build(ctx)))
    return path, path


def _dcp(folder: str, build, marker: str) -> tuple[str, str]:
    # torch.distributed.checkpoint.metadata.Metadata(state_dict_metadata, planner_data, storage_data)
    ctx = Ctx(marker)
    md = op.new(
        op.glob("torch.distributed.checkpoint.metadata", "Metadata"),
        op.dct({
            "state_dict_metadata": op.EMPTY_DICT,
            "planner_data": op.dct({"evil": build(ctx)}),
            "storage_data": op.EMPTY_DICT,
            "storage_meta": op.NONE,
            "version": op.text("1.0.0"),
        }),
    )
    path = os.path.join(folder, ".metadata")
    with open(path, "wb") as f:
        f.write(op.stream(md))
    return folder, path


def _megatron(folder: str, build, marker: str) -> tuple[str, str]:
    ctx = Ctx(marker)
    args = op.namespace({
        "tensor_model_parallel_size": op.integer(1),
        "pipeline_model_parallel_size": op.integer(1),
        "num_layers": op.integer(1),
        "hidden_size": op.integer(8),
        "evil": build(ctx),
    })
    state = op.stream(op.dct({
        "args": args,
        "checkpoint_version": op.floating(3.0),
        "iteration": op.integer(1),
        "model": op.dct({"embedding.word_embeddings.weight": ctx.tensor(size=(2, 2), stride=(2, 1))}),
    }))
    with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    rank = os.path.join(folder, "iter_0000001", "mp_rank_00")
    os.makedirs(rank)
    path = os.path.join(rank, "model_optim_rng.pt")
    torch_zip(path, state)
    return folder, path


def _deepspeed(folder: str, build, marker: str) -> tuple[str, str]:
    ctx = Ctx(marker)
    tag = os.path.join(folder, "global_step1")
    os.makedirs(tag)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("global_step1")
    model = op.stream(op.dct({
        "module": op.dct({"w": ctx.tensor()}),
        "buffer_names": op.EMPTY_LIST,
        "param_shapes": op.lst(op.dct({"w": op.value((4,))})),
        "global_steps": op.integer(1),
        "dp_world_size": op.integer(1),
        "mp_world_size": op.integer(1),
    }))
    torch_zip(os.path.join(tag, "mp_rank_00_model_states.pt"), model)
    optim = op.stream(op.dct({
        "optimizer_state_dict": op.dct({
            "zero_stage": op.integer(2),
            "partition_count": op.integer(1),
            "evil": build(ctx),
        })
    }))
    path = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch_zip(path, optim)
    return folder, path


def _meta_llama(folder: str, build, marker: str) -> tuple[str, str]:
    ctx = Ctx(marker)
    with open(os.path.join(folder, "params.json"), "w") as f:
        json.dump({"dim": 8, "n_layers": 1, "n_heads": 2, "vocab_size": 16}, f)
    path = os.path.join(folder, "consolidated.00.pth")
    torch_zip(path, state_with(ctx, build(ctx)))
    return folder, path


def _colossal(folder: str, build, marker: str) -> tuple[str, str]:
    ctx = Ctx(marker)
    path = os.path.join(folder, "pytorch_model-dist-00000.bin")
    torch_zip(path, state_with(ctx, build(ctx)))
    meta = {"checkpoint_version": "1.0", "total_size": 16, "metadata": {
        "w": {"offsets": [0], "lengths": [4], "global_shape": [4],
              "file": "pytorch_model-dist-00000.bin", "rank": 0}}}
    with open(os.path.join(folder, "pytorch_model-meta-dist-00000.json"), "w") as f:
        json.dump(meta, f)
    return folder, path


def paddle_state(ctx: Ctx, evil: bytes | None) -> bytes:
    """A paddle.save state dict: one fp32 array, its name table, and the payload."""
    items = {"llama.norm.weight": op.ndarray(b"\0" * 32, (8,))}
    if evil is not None:
        items["evil"] = evil
    items["StructuredToParameterName@@"] = op.dct({"llama.norm.weight": op.text("rms_norm_0.w_0")})
    return op.stream(op.dct(items))


def _pdparams(folder: str, build, marker: str) -> tuple[str, str]:
    path = os.path.join(folder, "model_state.pdparams")
    with open(path, "wb") as f:
        f.write(paddle_state(Ctx(marker), build(Ctx(marker))))
    return path, path


def _pdopt(folder: str, build, marker: str) -> tuple[str, str]:
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(LLAMA_CONFIG, f)
    with open(os.path.join(folder, "model_state.pdparams"), "wb") as f:
        f.write(paddle_state(Ctx(marker), None))
    ctx = Ctx(marker)
    opt = op.stream(op.dct({
        "rms_norm_0.w_0_moment1_0": op.ndarray(b"\0" * 32, (8,)),
        "evil": build(ctx),
    }))
    path = os.path.join(folder, "optimizer.pdopt")
    with open(path, "wb") as f:
        f.write(opt)
    return folder, path


CONTAINERS: dict[str, Container] = {
    c.name: c
    for c in (
        Container("torch-zip", _torch_zip, True, "torch.save zip archive, payload in data.pkl"),
        Container("torch-legacy", _torch_legacy, True, "legacy torch.save, payload in the object pickle"),
        Container("dcp-metadata", _dcp, False, "DCP folder, payload in .metadata"),
        Container("megatron-args", _megatron, True, "Megatron folder, payload in model_optim_rng.pt args"),
        Container("deepspeed-optim", _deepspeed, True, "DeepSpeed folder, payload in *_optim_states.pt"),
        Container("meta-llama", _meta_llama, True, "Meta Llama folder, payload in consolidated.00.pth"),
        Container("colossal-bin", _colossal, True, "ColossalAI folder, payload in a .bin weight file"),
        Container("paddle-pdparams", _pdparams, False, "paddle.save .pdparams, payload in the state dict"),
        Container("paddle-pdopt", _pdopt, False, "PaddleNLP folder, payload in optimizer.pdopt"),
    )
}


def open_path(container: str, path: str):
    """Open what a container wrote the way a user would: folders and `.pdparams` through format
    detection (`readers.open_source`), bare torch files with `torch_save.load`. Every tensor
    is read, so lazily-checked storages are exercised too."""
    from hybridckpt.containers.pickle import torch_save
    from hybridckpt.formats.registry import open_source
    from hybridckpt.io.byte_source import close_all
    from hybridckpt.lazy import LazyTensor

    try:
        if container in ("torch-zip", "torch-legacy"):
            obj = torch_save.load(path)
            for v in obj.values():
                if isinstance(v, LazyTensor):
                    v.materialize()
            return obj
        if container == "dcp-metadata":  # the folder has no data files: read the metadata
            from hybridckpt.containers.dcp_metadata import read_metadata

            return read_metadata(path)
        src = open_source(path)
        for t in src.tensors.values():
            t.materialize()
        return src
    finally:
        close_all()


def load_file(container: str, file: str):
    """Unpickle the one file a container planted its payload in, with the reader that format
    uses for it (no format-level checks)."""
    from hybridckpt.containers.dcp_metadata import DCP_POLICY
    from hybridckpt.containers.pickle import paddle_save, torch_save
    from hybridckpt.containers.pickle.machine import safe_load_file
    from hybridckpt.io.byte_source import close_all

    try:
        if container.startswith("paddle"):
            return paddle_save.safe_load(file)
        if container == "dcp-metadata":
            return safe_load_file(file, DCP_POLICY)
        return torch_save.load(file)
    finally:
        close_all()
