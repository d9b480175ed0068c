"""Fuzz targets: every parser hybridckpt runs on a user's bytes, with a valid seed input and a
hypothesis strategy of damaged versions of it. Shared by tests/test_fuzz.py (500 cases each)
and benchmarks/fuzz.py (10,000 each).

A case writes the mutated input where the parser expects it, runs the parser (and reads every
tensor it returns, so lazily-checked ranges are exercised too) and is judged by `judge`:
returning normally or raising a `HybridCkptError` that names the file is fine; any other
exception is an escape; a case running longer than `CASE_SECONDS` is a hang (a SIGALRM
interrupts it).

Strategies: byte mutations (overwrite, insert, delete, truncate; positions biased towards a
target's structural region: zip directory, safetensors header, the pickle opcodes around the
payloads) and, for JSON and DCP metadata, structural mutations (a field replaced by any JSON
value or Python value a pickle can carry: huge and negative ints, NaN, strings, nesting).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

CASE_SECONDS = 5.0


class Hang(Exception):
    """A fuzz case ran past CASE_SECONDS."""


@dataclass
class Outcome:
    escapes: list[str] = field(default_factory=list)  # "TypeError: ..." per escaping case
    hangs: int = 0
    cases: int = 0
    errors: int = 0  # project errors (the expected refusals)


@dataclass
class Target:
    """`setup(folder)` writes the seed input(s) and returns a state; `strategy(state)` draws a
    mutated input; `run(state, data)` writes it and parses; `file(state)` is the file a
    project error must name."""

    name: str
    setup: Callable[[str], dict]
    strategy: Callable[[dict], st.SearchStrategy]
    run: Callable[[dict, object], None]
    cases: int = 500  # per run of tests/test_fuzz.py (a target whose case opens a whole checkpoint: fewer)


# -- mutation strategies ---------------------------------------------------------------------------


def mutated_bytes(base: bytes, hot: tuple[int, int] | None = None) -> st.SearchStrategy[bytes]:
    """`base` with 1-4 edits; 3 in 4 positions fall in `hot` = [start, end) when given."""
    n = len(base)

    def pos():
        anywhere = st.integers(0, max(0, n - 1))
        if hot is None:
            return anywhere
        return st.one_of(anywhere, *[st.integers(hot[0], max(hot[0], hot[1] - 1))] * 3)

    edit = st.one_of(
        st.tuples(st.just("set"), pos(), st.integers(0, 255)),
        st.tuples(st.just("xor"), pos(), st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 255])),
        st.tuples(st.just("insert"), pos(), st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("delete"), pos(), st.integers(1, 16)),
        st.tuples(st.just("truncate"), pos(), st.just(0)),
        st.tuples(st.just("int32"), pos(), st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 2**20])),
    )

    def apply(edits) -> bytes:
        b = bytearray(base)
        for kind, p, v in edits:
            p = min(p, max(0, len(b) - 1))
            if kind == "set" and b:
                b[p] = v
            elif kind == "xor" and b:
                b[p] ^= v
            elif kind == "insert":
                b[p:p] = v
            elif kind == "delete":
                del b[p : p + v]
            elif kind == "truncate":
                del b[p:]
            elif kind == "int32" and len(b) >= p + 4:
                b[p : p + 4] = struct.pack("<I", v)
        return bytes(b)

    return st.lists(edit, min_size=1, max_size=4).map(apply)


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 300),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
        st.sampled_from(["", "..", "../x", "/etc/passwd", "model.safetensors", "a" * 300]),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8,
)


def _paths(doc, prefix=()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _replace(doc, path: tuple, value):
    if not path:
        return doc if value is _DELETE else value
    doc = json.loads(json.dumps(doc))
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


def mutated_json(doc) -> st.SearchStrategy[bytes]:
    """JSON text of `doc` with 1-3 subtrees replaced or deleted, or its bytes mutated."""
    paths = _paths(doc)

    def edit_many(edits):
        d = doc
        for path, value in edits:
            try:
                d = _replace(d, path, value)
            except (KeyError, IndexError, TypeError):
                pass
        return json.dumps(d, allow_nan=True).encode()

    structural = st.lists(
        st.tuples(st.sampled_from(paths), st.one_of(JSON_VALUES, st.just(_DELETE))), min_size=1, max_size=3
    ).map(edit_many)
    return st.one_of(structural, structural, mutated_bytes(json.dumps(doc).encode()))


# -- helpers ---------------------------------------------------------------------------------------


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read_all(obj, depth: int = 0) -> None:
    """Materialize every LazyTensor reachable in `obj` (dicts, lists, sources)."""
    from hybridckpt.lazy import LazyTensor

    if depth > 20:
        return
    if isinstance(obj, LazyTensor):
        obj.materialize()
    elif isinstance(obj, dict):
        for v in list(obj.values()):
            _read_all(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _read_all(v, depth + 1)
    elif hasattr(obj, "tensors") and isinstance(obj.tensors, dict):
        _read_all(dict(obj.tensors), depth + 1)
        opt = getattr(obj, "optimizer", None)
        if opt is not None:
            _read_all([*(dict(s) for s in opt.slots.values()), dict(opt.master)], depth + 1)


def _sample_tree():
    import argparse
    import collections

    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "ids": np.arange(5, dtype=np.int64),
        "args": argparse.Namespace(lr=1e-3, layers=[1, 2], name="x"),
        "od": collections.OrderedDict([("a", 1), ("b", (2.5, None))]),
        "bytes": b"\x00\x01" * 8,
        "nested": {"k": [{"v": 1.5}, {2, 3}]},
    }


# -- targets ---------------------------------------------------------------------------------------


def _pickle_setup(folder: str) -> dict:
    return {"bases": [pickle.dumps(_sample_tree(), protocol=2), pickle.dumps(_sample_tree(), protocol=4)]}


def _pickle_strategy(state):
    return st.one_of(*(mutated_bytes(b) for b in state["bases"]))


def _pickle_run(state, data: bytes) -> None:
    from hybridckpt.containers.pickle.machine import safe_loads
    from hybridckpt.containers.pickle.torch_policy import TORCH_POLICY

    safe_loads(data, TORCH_POLICY, what="fuzz.pkl")


def _torch_setup(folder: str, legacy: bool) -> dict:
    import argparse

    import torch

    path = os.path.join(folder, "legacy.pt" if legacy else "model.pt")
    obj = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "view": torch.arange(6.0)[1:5],
           "h": torch.ones(2, dtype=torch.float16), "args": argparse.Namespace(tp=2)}
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    base = open(path, "rb").read()
    hot = None
    if not legacy:
        with zipfile.ZipFile(path) as z:
            hot = (z.start_dir, len(base))  # central directory and end records
    return {"path": path, "base": base, "hot": hot}


def _torch_run(state, data: bytes) -> None:
    from hybridckpt.containers.pickle import torch_save

    _write(state["path"], data)
    _read_all(torch_save.load(state["path"]))


def _safetensors_setup(folder: str) -> dict:
    from hybridckpt.containers.safetensors_file import write

    path = os.path.join(folder, "model.safetensors")
    write(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int64),
                 "c": np.zeros((0, 2), np.float16)}, {"format": "pt", "k": "v"})
    base = open(path, "rb").read()
    (n,) = struct.unpack("<Q", base[:8])
    header = json.loads(base[8 : 8 + n])
    return {"path": path, "base": base, "hot": (0, 8 + n), "header": header, "data": base[8 + n :]}


def _safetensors_strategy(state):
    def assemble(h: bytes) -> bytes:
        return struct.pack("<Q", len(h)) + h + state["data"]

    return st.one_of(mutated_bytes(state["base"], state["hot"]), mutated_json(state["header"]).map(assemble))


def _safetensors_run(state, data: bytes) -> None:
    from hybridckpt.containers.safetensors_file import read_header

    _write(state["path"], data)
    _read_all(dict(read_header(state["path"]).tensors))


def _dcp_setup(folder: str) -> dict:
    from attacks.sources import _llama_ref, write_dcp

    out = os.path.join(folder, "dcp")
    write_dcp(out, _llama_ref(3), ranks=2)
    path = os.path.join(out, ".metadata")
    base = open(path, "rb").read()
    import torch  # noqa: F401 - the DCP classes, to edit the metadata as objects

    return {"path": path, "folder": out, "base": base, "md": pickle.loads(base)}


_ODD_VALUES = st.one_of(
    st.none(), st.integers(-(2**65), 2**65), st.integers(-2, 40), st.text(max_size=6),
    st.lists(st.integers(-2, 40), max_size=3), st.tuples(st.integers(-2, 40), st.integers(-2, 40)),
    st.sampled_from(["../x", "/etc/passwd", "__0_0.distcp", ""]),
)


def _dcp_strategy(state):
    """Byte mutations of the pickle, or one field of the metadata objects replaced."""
    import copy

    md = state["md"]
    fqns = sorted(md.state_dict_metadata)

    def edit(args) -> bytes:
        import torch

        which, i, j, attr, value = args
        m = copy.deepcopy(md)
        fqn = fqns[i % len(fqns)]
        entry = m.state_dict_metadata[fqn]
        try:
            if which == "chunk" and getattr(entry, "chunks", None):
                c = entry.chunks[j % len(entry.chunks)]
                v = torch.Size(value) if isinstance(value, (list, tuple)) and all(x >= 0 for x in value) else value
                setattr(c, attr if attr in ("offsets", "sizes") else "sizes", v)
            elif which == "size" and hasattr(entry, "size"):
                entry.size = torch.Size(value) if isinstance(value, (list, tuple)) and all(x >= 0 for x in value) else value
            elif which == "drop_chunk" and getattr(entry, "chunks", None):
                del entry.chunks[j % len(entry.chunks)]
            elif which == "storage":
                idx = list(m.storage_data)[j % len(m.storage_data)]
                info = m.storage_data[idx]
                name = {"offsets": "offset", "sizes": "length"}.get(attr, "relative_path")
                object.__setattr__(info, name, value)
            elif which == "top":
                setattr(m, {"offsets": "state_dict_metadata", "sizes": "storage_data"}.get(attr, "planner_data"), value)
        except (TypeError, ValueError, AttributeError):
            pass
        return pickle.dumps(m)

    structural = st.tuples(
        st.sampled_from(["chunk", "size", "drop_chunk", "storage", "top"]), st.integers(0, 10**6),
        st.integers(0, 10**6), st.sampled_from(["offsets", "sizes", "other"]), _ODD_VALUES,
    ).map(edit)
    return st.one_of(structural, structural, mutated_bytes(state["base"]))


def _dcp_run(state, data: bytes) -> None:
    from hybridckpt.containers.dcp_metadata import read_metadata

    _write(state["path"], data)
    read_metadata(state["folder"])


def _paddle_pickle_setup(folder: str) -> dict:
    from fixtures import paddle_writer as pw

    path = os.path.join(folder, "model_state.pdparams")
    rng = np.random.default_rng(0)
    obj = {"big": pw.PTensor("linear_0.w_0", rng.standard_normal((40, 40)).astype(np.float32)),
           "small": pw.PTensor("linear_0.b_0", np.arange(3, dtype=np.float32)),
           "sched": {"last_epoch": 3, "lr": 0.1}}
    pw.paddle_save(obj, path, protocol=4)
    base = open(path, "rb").read()
    return {"path": path, "base": base}


def _paddle_pickle_strategy(state):
    base = state["base"]
    return st.one_of(mutated_bytes(base, (0, min(len(base), 400))), mutated_bytes(base, (len(base) - 700, len(base))))


def _paddle_pickle_run(state, data: bytes) -> None:
    from hybridckpt.containers.pickle import paddle_save

    _write(state["path"], data)
    d = paddle_save.read(state["path"])
    _read_all(dict(d.tensors))


def _paddle_json_setup(folder: str) -> dict:
    from fixtures import paddle_writer as pw

    out = os.path.join(folder, "paddle")
    ref = pw.reference_llama(2, vocab=16, hidden=8, mlp=8, layers=1, heads=2, kv_heads=2)
    pw.write_hybrid(out, ref, pw.Options(sharding=2, strategy="v2", sharded_model=True, model_state=False,
                                         bf16=True, buffer_elements=200))
    path = os.path.join(out, "model_meta.json")
    return {"path": path, "folder": out, "doc": json.load(open(path))}


def _json_strategy(state):
    return mutated_json(state["doc"])


def _paddle_rank_setup(folder: str) -> dict:
    """The same hybrid checkpoint, one rank's optimizer file (`optimizer.shard01.pdopt`: the
    sharding v2 buffers sliced by `model_meta.json`) mutated."""
    state = _paddle_json_setup(folder)
    path = os.path.join(state["folder"], "optimizer.shard01.pdopt")
    return {"path": path, "folder": state["folder"], "base": open(path, "rb").read()}


def _paddle_json_run(state, data: bytes) -> None:
    from hybridckpt.formats import paddle

    _write(state["path"], data)
    _read_all(paddle.open(state["folder"]))


def _colossal_setup(folder: str) -> dict:
    from fixtures import colossal_writer as cw
    from fixtures import paddle_writer as pw

    out = os.path.join(folder, "colossal")
    ref = pw.reference_llama(4, vocab=12, hidden=8, mlp=8, layers=1, heads=2, kv_heads=2)
    cw.write_colossal(out, ref.params, layers=1, tp=2, safetensors=True, params_per_shard=20)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(ref.config, f)
    path = os.path.join(out, "pytorch_model-meta-dist-00001.index.json")
    return {"path": path, "folder": out, "doc": json.load(open(path))}


def _colossal_run(state, data: bytes) -> None:
    from hybridckpt.formats import colossal

    _write(state["path"], data)
    _read_all(colossal.open(state["folder"]))


def _hf_index_setup(folder: str) -> dict:
    from hybridckpt.formats.hf.write import write_sharded

    out = os.path.join(folder, "hf")
    os.makedirs(out)
    rng = np.random.default_rng(1)
    from hybridckpt.lazy import ArrayTensor

    tensors = {f"model.layers.{i}.w": ArrayTensor(rng.standard_normal((4, 4)).astype(np.float32)) for i in range(6)}
    write_sharded(out, tensors, stem="model", max_shard_bytes=100)
    path = os.path.join(out, "model.safetensors.index.json")
    return {"path": path, "folder": out, "doc": json.load(open(path))}


def _hf_index_run(state, data: bytes) -> None:
    from hybridckpt.formats import hf

    _write(state["path"], data)
    _read_all(hf.read_tensors(state["folder"], hf.WEIGHTS, hf.INDEX))


# -- whole checkpoints: our store and MaxText's, one file of them mutated --------------------------

_CASES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "real", "cases")
_MAXTEXT_CONFIG = os.path.join(_CASES_DIR, "torchtitan_llama3", "config.json")


def _opened_all(path: str, config: str | None = None) -> None:
    """Open `path` as every job does (`jobs.open`: the format's reader, then the rules) and read
    every param and optimizer slot it gives."""
    from hybridckpt.jobs.open import open_checkpoint

    named = open_checkpoint(path, config=config).named
    _read_all([dict(named.params), *(dict(t) for t in named.slots.values())])


def _store_setup(folder: str, rel: str) -> dict:
    """A real import of the demo sample (CRC tables recorded); `rel`: the file mutated, relative
    to the step folder (a JSON document, or a chunk file's bytes)."""
    import glob

    from hybridckpt.demo import sample_path
    from hybridckpt.jobs import import_checkpoint

    root = os.path.join(folder, "store")
    import_checkpoint(sample_path(), root)
    step = glob.glob(os.path.join(root, "*", "params"))[0].rsplit(os.sep, 1)[0]
    path = glob.glob(os.path.join(step, rel))[0]
    base = open(path, "rb").read()
    state = {"path": path, "folder": root, "base": base}
    if not rel.split("/")[-1][0].isdigit():
        state["doc"] = json.loads(base)
    return state


def _maxtext_setup(folder: str, rel: str) -> dict:
    """MaxText 0.2.5's own save (`tests/real/cases/maxtext_llama3`) copied; `rel` as above, to
    the `items` folder."""
    import shutil

    root = os.path.join(folder, "maxtext")
    shutil.copytree(os.path.join(_CASES_DIR, "maxtext_llama3", "ckpt"), root)
    path = os.path.join(root, "4", "items", rel)
    base = open(path, "rb").read()
    return {"path": path, "folder": root, "base": base, "doc": json.loads(base), "config": _MAXTEXT_CONFIG}


def _whole_run(state, data: bytes) -> None:
    _write(state["path"], data)
    _opened_all(state["folder"], state.get("config"))


def _whole_strategy(state):
    return mutated_json(state["doc"]) if "doc" in state else mutated_bytes(state["base"])


def _flex_setup(folder: str, rel: str) -> dict:
    """PaddleFormers 1.2's own FlexCheckpoint (`tests/real/cases/paddleformers_untied_bf16_sharding2`,
    two ranks) copied; `rel`: the file whose bytes are mutated, relative to `checkpoint-3`."""
    import shutil

    root = os.path.join(folder, "flex")
    shutil.copytree(os.path.join(_CASES_DIR, "paddleformers_untied_bf16_sharding2", "ckpt", "flex"), root)
    step = os.path.join(root, "checkpoint-3")
    path = os.path.join(step, rel)
    return {"path": path, "folder": step, "base": open(path, "rb").read()}


def _flex_run(state, data: bytes) -> None:
    from hybridckpt.formats import flex_checkpoint

    _write(state["path"], data)
    _read_all(flex_checkpoint.open(state["folder"]))


def _torch_dcp_setup(folder: str) -> dict:
    """torch's own `dcp.save` (in process, protocol 4 with frames: the `.metadata` the fast reader,
    `containers.dcp_fast`, reads record by record) of a state dict with optimizer-like entries."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    out = os.path.join(folder, "torch_dcp")
    state = {"model": {f"layers.{i}.w": torch.arange(12.0).reshape(3, 4) + i for i in range(4)},
             "optim": {"state": {"layers.0.w": {"exp_avg": torch.ones(3, 4), "step": torch.tensor(2.0)}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=out, no_dist=True)
    path = os.path.join(out, ".metadata")
    return {"path": path, "folder": out, "base": open(path, "rb").read()}


_WHOLE = 150  # cases of a whole-checkpoint target: each opens and reads a checkpoint (~0.1 s)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("pickle stream", _pickle_setup, _pickle_strategy, _pickle_run),
        Target("torch zip directory", lambda f: _torch_setup(f, legacy=False),
               lambda s: mutated_bytes(s["base"], s["hot"]), _torch_run),
        Target("torch legacy", lambda f: _torch_setup(f, legacy=True),
               lambda s: mutated_bytes(s["base"], (0, min(len(s["base"]), 600))), _torch_run),
        Target("safetensors header", _safetensors_setup, _safetensors_strategy, _safetensors_run),
        Target("DCP metadata", _dcp_setup, _dcp_strategy, _dcp_run),
        Target("Paddle pickle", _paddle_pickle_setup, _paddle_pickle_strategy, _paddle_pickle_run),
        Target("Paddle model_meta JSON", _paddle_json_setup, _json_strategy, _paddle_json_run),
        Target("Colossal metadata JSON", _colossal_setup, _json_strategy, _colossal_run),
        Target("HF index JSON", _hf_index_setup, _json_strategy, _hf_index_run),
        Target("our store _METADATA", lambda f: _store_setup(f, "params/_METADATA"), _whole_strategy, _whole_run, _WHOLE),
        Target("our store .zarray", lambda f: _store_setup(f, "params/layers.q.kernel/.zarray"), _whole_strategy,
               _whole_run, _WHOLE),
        Target("our store trainer_state", lambda f: _store_setup(f, "trainer_state/metadata"), _whole_strategy,
               _whole_run, _WHOLE),
        Target("our store chunk", lambda f: _store_setup(f, "params/embed.embedding/0.0"), _whole_strategy, _whole_run,
               _WHOLE),
        Target("MaxText _METADATA", lambda f: _maxtext_setup(f, "_METADATA"), _whole_strategy, _whole_run, _WHOLE),
        Target("MaxText .zarray", lambda f: _maxtext_setup(f, "params.params.decoder.layers.mlp.wi_0.kernel/.zarray"),
               _whole_strategy, _whole_run, _WHOLE),
        Target("MaxText step .zarray", lambda f: _maxtext_setup(f, "step/.zarray"), _whole_strategy, _whole_run, _WHOLE),
        Target("FlexCheckpoint metadata", lambda f: _flex_setup(f, "model_state/0.metadata"),
               lambda s: mutated_bytes(s["base"]), _flex_run, _WHOLE),
        Target("FlexCheckpoint distcp", lambda f: _flex_setup(f, "optimizer_state/1_0.distcp"),
               lambda s: mutated_bytes(s["base"], (0, min(len(s["base"]), 600))), _flex_run, _WHOLE),
        Target("Paddle hybrid rank file", _paddle_rank_setup,
               lambda s: mutated_bytes(s["base"], (0, min(len(s["base"]), 600))), _paddle_json_run, _WHOLE),
        Target("DCP metadata, torch's own (fast reader)", _torch_dcp_setup, lambda s: mutated_bytes(s["base"]), _dcp_run),
    )
}


def _alarm(signum, frame):
    raise Hang(f"case ran longer than {CASE_SECONDS} s")


def run_case(target: Target, state: dict, data, outcome: Outcome) -> None:
    """Run one case under a SIGALRM of CASE_SECONDS and record what happened."""
    from hybridckpt.errors import HybridCkptError
    from hybridckpt.io.byte_source import close_all

    outcome.cases += 1
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_SECONDS)
    try:
        target.run(state, data)
    except Hang:
        outcome.hangs += 1
    except HybridCkptError:
        outcome.errors += 1
    except Exception as e:  # noqa: BLE001 - an escape, recorded
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        outcome.escapes.append(
            f"{type(e).__name__}: {str(e)[:200]} (at {os.path.basename(where.filename)}:{where.lineno})"
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        close_all()


def _register_extra() -> None:
    """The targets of real tools' torch.save files mutated below their CRCs (attacks/fuzz_trees.py)."""
    from attacks.fuzz_trees import EXTRA

    TARGETS.update((t.name, t) for t in EXTRA)


_register_extra()
