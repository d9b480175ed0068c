"""DeepSpeed ZeRO-3 at many ranks: what opening costs must not grow with ranks x params.

Measured on a Llama 405B ZeRO-3 checkpoint of 512 ranks (docs/scale.md, `benchmarks/
scale_zero3.py`): parsing every rank's model states (512 copies of a 1137-param module) and a
slice view per rank per param per kind (1.75M objects) made `inspect` 2.4x slower than
DeepSpeed's own parse and 2.2x its memory. These tests pin the two fixes on files the real
DeepSpeed 0.19.8 writes (tests/fixtures/ds_writer.py, variant z3: 3 ranks, 3 sub-groups, a
frozen param) and on views of many ranks built in memory.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
import torch
from fixtures import FIXTURES
from fixtures.ckpt_checks import run_writer
from fixtures.torch_common import load_reference

from hybridckpt import lazy
from hybridckpt.containers.pickle import torch_save
from hybridckpt.errors import FormatError
from hybridckpt.formats import deepspeed as ds
from hybridckpt.formats.deepspeed import partitions
from hybridckpt.formats.deepspeed.ranks import Rank
from hybridckpt.formats.deepspeed.zero3_flat import Zero3Flat
from hybridckpt.lazy.box import full_box

TAG = "global_step3"


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_z3")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "DS_WRITER_VARIANTS": "z3"}
    run_writer(os.path.join(FIXTURES, "ds_writer.py"), out, env=env)
    return out


def _nodes(t, seen: set) -> None:
    """Every lazy tensor `t` is built from (by identity)."""
    if id(t) in seen or not isinstance(t, lazy.LazyTensor):
        return
    seen.add(id(t))
    for a in ("src", "stored", "flat"):
        _nodes(getattr(t, a, None), seen)
    for p in (getattr(t, "parts", None) or ()) + (getattr(t, "flats", None) or ()):
        _nodes(p, seen)


def _ranks(dp: int, sizes: list[int], subgroups: int, rng) -> tuple[list[Rank], list[np.ndarray]]:
    """`dp` ranks holding params of `sizes` elements the ZeRO-3 way, each rank's flat in
    `subgroups` pieces; and the full params (fp32 master; the slot is the master + 1)."""
    full = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    flats = []
    for r in range(dp):
        parts = []
        for v in full:
            pn = math.ceil(v.size / dp)
            parts.append(np.pad(v, (0, pn * dp - v.size), constant_values=np.nan)[r * pn : (r + 1) * pn])
        flats.append(np.concatenate(parts))
    ranks = []
    for r, f in enumerate(flats):
        cuts = np.linspace(0, f.size, subgroups + 1).astype(int)
        master = [lazy.ArrayTensor(f[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        slot = [lazy.ArrayTensor(f[a:b] + 1) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        ranks.append(Rank(f"rank{r}", master, {"exp_avg": slot}, [0] * subgroups, None, [], None))
    return ranks, full


def test_zero3_views_do_not_grow_with_ranks_and_read_exactly():
    rng = np.random.default_rng(0)
    sizes = [130, 7, 1, 0, 4096, 999]
    shapes = [(13, 10), (7,), (1,), (0,), (64, 64), (27, 37)]
    out = {}
    for dp in (3, 64):
        ranks, full = _ranks(dp, sizes, 3, rng)
        params = partitions.zero3(ranks, [{f"p{i}": s for i, s in enumerate(shapes)}], "model_states")
        seen: set = set()
        for kinds in params.values():
            for t in kinds.values():
                _nodes(t, seen)
        # the ranks' flats (a Concat of 3 sub-groups each, per kind) are shared; a param adds a
        # constant number of views per kind, whatever dp is (a slice per rank before)
        shared = dp * 2 * (1 + 3)
        out[dp] = len(seen) - shared
        for i, v in enumerate(full):
            for kind, ref in (("fp32", v), ("exp_avg", v + 1)):
                t = params[f"p{i}"][kind]
                assert t.shape == shapes[i]
                assert np.array_equal(t.materialize(), ref.reshape(shapes[i]))
                if t.ndim == 2 and t.size:  # a box crossing rank (and sub-group) edges
                    box = ((1, t.shape[0] - 1), (2, t.shape[1]))
                    assert np.array_equal(t.read_box(box), ref.reshape(shapes[i])[1:-1, 2:])
    assert out[3] == out[64] <= 2 * 2 * len(sizes)


def test_zero3_flat_file_runs_are_the_files_bytes(root):
    """An import reads a ZeRO-3 param through `file_runs`: the runs over the ranks' files hold
    exactly the param's bytes (DeepSpeed's own gathered param as reference)."""
    src = ds.open(os.path.join(root, "z3"))
    ref, _ = load_reference(root, "z3")
    for name in ("fc1.weight", "fc2.weight", "wte.weight", "ln_f.bias"):
        t = src.tensors[name]
        flat = t.src if isinstance(t, lazy.Reshape) else t
        assert isinstance(flat, Zero3Flat)
        runs = t.file_runs(full_box(t.shape), 64)
        assert runs is not None and len(runs) >= 2  # over several ranks' files
        data = b"".join(r.source.read(r.offset, r.nbytes) for r in runs)
        assert np.array_equal(np.frombuffer(data, np.float32).reshape(t.shape), ref[f"param/{name}"])
    assert src.tensors["fc1.weight"].src.stored_pieces() == 3  # one piece on each rank


def _without_frozen(root, tmp_path) -> str:
    """The real z3 save with its frozen param removed from every rank's model states (torch
    re-saves them): the ranks' model-states pickles are then copies of one another, as in a
    run without frozen params."""
    tag = tmp_path / "z3" / TAG
    shutil.copytree(os.path.join(root, "z3", TAG), tag)
    for r in range(3):
        f = tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
        m = torch.load(f, weights_only=False)
        m["frozen_param_shapes"].clear()
        m["frozen_param_fragments"].clear()
        torch.save(m, f)
    return str(tag)


def test_zero3_model_states_of_other_ranks_are_compared_not_parsed(root, tmp_path, monkeypatch):
    tag = _without_frozen(root, tmp_path)
    parsed = []
    load = torch_save.load

    def counting(path, **kw):
        parsed.append(os.path.basename(path))
        return load(path, **kw)

    def model_files():
        return sorted(p for p in parsed if "model_states" in p)

    monkeypatch.setattr(torch_save, "load", counting)
    src = ds.open(tag)
    # DeepSpeed writes `shared_params` (the tied head) in rank 0's file only: ranks 1 and 2 are
    # copies of one another, and rank 2's is compared with rank 1's, not parsed
    assert model_files() == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    ref, _ = load_reference(root, "z3")
    assert np.array_equal(src.tensors["fc1.weight"].materialize(), ref["param/fc1.weight"])
    assert np.array_equal(src.tensors["lm_head.weight"].materialize(), ref["param/wte.weight"])

    # a rank whose pickle differs from every other is parsed, as before
    f = os.path.join(tag, "zero_pp_rank_2_mp_rank_00_model_states.pt")
    m = torch.load(f, weights_only=False)
    m["global_steps"] = 4
    torch.save(m, f)
    parsed.clear()
    ds.open(tag)
    assert model_files() == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)]

    # a damaged copy is still refused, naming it
    f = os.path.join(tag, "zero_pp_rank_2_mp_rank_00_model_states.pt")
    shutil.copy(os.path.join(tag, "zero_pp_rank_1_mp_rank_00_model_states.pt"), f)
    raw = bytearray(open(f, "rb").read())
    raw[raw.index(b"global_steps")] ^= 0x20
    with open(f, "wb") as fh:
        fh.write(raw)
    with pytest.raises(FormatError, match="zero_pp_rank_2_mp_rank_00_model_states.pt"):
        ds.open(tag)
