"""Fuzz targets whose input is a real tool's `torch.save` file, mutated below its CRCs: the
readers behind a torch zip (DeepSpeed's ZeRO files, Megatron's torch_dist metadata) otherwise
see byte mutations only as a refused CRC (`containers.pickle.torch_save` checks every entry).

A case is one of:
- structural: the real file loaded by torch (a trusted fixture, test side), 1-3 of its values
  (a dict entry, a list or tuple element, at any depth) replaced by an odd value (JSON-like
  values, huge and negative ints, odd tensors, shapes with huge or negative sizes) or deleted,
  and saved again by `torch.save`: what the reader sees is a valid archive and pickle of a
  hostile object;
- pickle bytes: `data.pkl` byte-mutated and the archive re-zipped with its CRC recomputed.
Each case opens and reads the whole checkpoint (`fuzzers._whole_run`).
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import zipfile

from hypothesis import strategies as st

from attacks.fuzzers import _CASES_DIR, JSON_VALUES, Target, _whole_run, mutated_bytes

_DELETE = object()
_CASES = 100  # per run of tests/test_fuzz.py at the deep profile (50 by default): whole checkpoints


def _odd_values():
    import torch

    sizes = st.lists(st.sampled_from([-1, 0, 1, 3, 2**31, 2**40, 2**62]), min_size=0, max_size=3)
    tensors = st.sampled_from(["empty", "int", "half", "scalar", "2d", "bool", "complex", "int scalar"]).map(
        lambda k: {"empty": torch.zeros(0), "int": torch.arange(3), "half": torch.ones(2, 2, dtype=torch.float16),
                   "scalar": torch.tensor(7.0), "2d": torch.ones(5, 3), "bool": torch.ones(4, dtype=torch.bool),
                   "complex": torch.ones(3, dtype=torch.complex64), "int scalar": torch.tensor(-5)}[k]
    )
    return st.one_of(JSON_VALUES, sizes.map(tuple), sizes.map(lambda s: torch.Size([abs(x) for x in s])), tensors,
                     st.just(_DELETE))


def _paths(obj, prefix=(), depth=0) -> list[tuple]:
    import torch

    out = [prefix] if prefix else []
    if depth > 7 or isinstance(obj, torch.Tensor):
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,), depth + 1)
    return out


def _set(node, path: tuple, value):
    """`node` with the value at `path` replaced (or deleted); tuples (torch.Size) rebuilt."""
    if not path:
        return value
    k, rest = path[0], path[1:]
    if isinstance(node, dict):
        if k in node:
            if not rest and value is _DELETE:
                del node[k]
            else:
                node[k] = _set(node[k], rest, value)
        return node
    if isinstance(node, (list, tuple)) and isinstance(k, int) and k < len(node):
        items = list(node)
        if not rest and value is _DELETE:
            del items[k]
        else:
            items[k] = _set(items[k], rest, value)
        if isinstance(node, list):
            node[:] = items
            return node
        try:
            return type(node)(items)
        except (TypeError, ValueError):
            return tuple(items)
    return node


def _rezip(base: bytes, pickle_bytes: bytes) -> bytes:
    """The torch.save archive `base` with its `data.pkl` replaced (CRC recomputed)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(base)) as z, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as w:
        for info in z.infolist():
            data = pickle_bytes if info.filename.endswith("/data.pkl") else z.read(info)
            w.writestr(info.filename, data)
    return out.getvalue()


def _tree_setup(folder: str, case: str, rel: str, ckpt: str = "ckpt") -> dict:
    """`tests/real/cases/<case>/<ckpt>` copied; `rel`: the torch.save file mutated, relative
    to the copy; the checkpoint opened is the copy."""
    import torch

    root = os.path.join(folder, case)
    shutil.copytree(os.path.join(_CASES_DIR, case, ckpt), root)
    path = os.path.join(root, rel)
    base = open(path, "rb").read()
    obj = torch.load(io.BytesIO(base), weights_only=False, map_location="cpu")  # trusted: the fixture
    with zipfile.ZipFile(io.BytesIO(base)) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    return {"path": path, "folder": root, "base": base, "obj": obj, "pkl": pkl}


def _tree_strategy(state):
    import torch

    obj, paths = state["obj"], _paths(state["obj"])

    def save(edits) -> bytes:
        m = copy.deepcopy(obj)
        for path, value in edits:
            m = _set(m, path, value)
        buf = io.BytesIO()
        torch.save(m, buf)
        return buf.getvalue()

    structural = st.lists(st.tuples(st.sampled_from(paths), _odd_values()), min_size=1, max_size=3).map(save)
    pickled = mutated_bytes(state["pkl"]).map(lambda p: _rezip(state["base"], p))
    return st.one_of(structural, structural, pickled)


def _bytes_setup(folder: str, case: str, rel: str) -> dict:
    """`tests/real/cases/<case>/ckpt` copied; `rel`: the file whose bytes are mutated."""
    root = os.path.join(folder, case)
    shutil.copytree(os.path.join(_CASES_DIR, case, "ckpt"), root)
    path = os.path.join(root, rel)
    return {"path": path, "folder": root, "base": open(path, "rb").read()}


_ZERO2 = "hf_trainer_deepspeed_zero2"

EXTRA: tuple[Target, ...] = (
    Target("DeepSpeed ZeRO-2 optim_states", lambda f: _tree_setup(
        f, _ZERO2, "checkpoint-3/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        _tree_strategy, _whole_run, _CASES),
    Target("DeepSpeed ZeRO-2 model_states", lambda f: _tree_setup(
        f, _ZERO2, "checkpoint-3/global_step3/mp_rank_00_model_states.pt"), _tree_strategy, _whole_run, _CASES),
    Target("DeepSpeed universal optimizer_state", lambda f: _tree_setup(
        f, "deepspeed_universal_zero2", "global_step3_universal/zero/optimizer_state.pt"),
        _tree_strategy, _whole_run, _CASES),
    Target("DeepSpeed universal param file", lambda f: _tree_setup(
        f, "deepspeed_universal_zero2", "global_step3_universal/zero/lm_head.weight/exp_avg.pt"),
        _tree_strategy, _whole_run, _CASES),
    Target("Lightning .ckpt", lambda f: _tree_setup(f, "lightning_ckpt_index", "step=3.ckpt"),
           _tree_strategy, _whole_run, _CASES),
    # megatron-core's torch_dist save (DCP `.metadata`, read by the fast reader, then the layout)
    Target("Megatron torch_dist .metadata", lambda f: _bytes_setup(
        f, "megatron_core_dense_dp_reshardable", "iter_0000003/.metadata"),
        lambda s: mutated_bytes(s["base"]), _whole_run, _CASES),
)
