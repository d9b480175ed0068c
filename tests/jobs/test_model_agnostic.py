"""The model-agnostic path: checkpoints with no model config anywhere (none in the files, no
`--config`) are listed, consolidated and imported under the source's own names.

Fixtures are written in the session by the real tools, and every reference comes from the
tool's own consolidation, not from our readers:

- DCP: 16 plain fp32 tensors `model.layers.N.mlp.up_proj.weight` [64, 32] saved with
  `dcp.save(..., no_dist=True)` (one piece each), a variant with an optimizer-like state
  (`optim.state.<name>.exp_avg` / `exp_avg_sq` / `step`), and the same tensors saved by 2 gloo
  ranks as DTensors (`Shard(0)` and `Shard(1)`: two pieces each). Reference:
  `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`, read with `torch.load`.
- DeepSpeed ZeRO-3 (tests/fixtures/ds_writer.py, variant `z3`: a tiny model of no known
  family, 3 ranks, a tied head, a frozen param). Reference: DeepSpeed's `zero_to_fp32`
  (`get_fp32_state_dict_from_zero_checkpoint`), run in its own process.
- ColossalAI (tests/fixtures/colossal_writer.py, tp=2 pp=2), no config.json (as the tool writes it).
  Reference: the full tensors the writer split.

Our Orbax import of the DCP source is restored onto three other meshes and compared bit for
bit; its shardings are the generic rule's (`plan.generic_spec`: `fsdp` on the largest dim it
divides, then `tp`), asserted as literal PartitionSpecs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from fixtures import FIXTURES
from fixtures import colossal_writer as cw
from fixtures import paddle_writer as pw
from fixtures.torch_common import load_reference
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from hybridckpt.cli import main
from hybridckpt.mesh import MeshShape

LAYERS = 16
SHAPE = (64, 32)  # [out, in]
NAMES = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(LAYERS)]
STEP = 7
DS_WRITER = os.path.join(FIXTURES, "ds_writer.py")
TESTS = os.path.dirname(FIXTURES)  # on sys.path for `fixtures` in the writers' own processes

# 2 gloo ranks save the same 16 tensors as DTensors: even layers split on dim 0 (FSDP2), odd
# layers on dim 1 (row-parallel TP); every rank creates only its half
_RANKS_WRITER = """
import sys
tests, out, layers, shape = sys.argv[1], sys.argv[2], int(sys.argv[3]), (int(sys.argv[4]), int(sys.argv[5]))
sys.path.insert(0, tests)
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from fixtures.torch_common import fork_ranks, gloo_rank

def worker(rank, out, layers, shape, port):
    with gloo_rank(rank, 2, port):
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(rank)
        sd = {}
        for i in range(layers):
            dim = i % 2
            local = [n // 2 if d == dim else n for d, n in enumerate(shape)]
            t = torch.randn(*local, generator=g)
            sd[f"model.layers.{i}.mlp.up_proj.weight"] = DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)
        dcp.save(sd, checkpoint_id=out)
        dist.barrier()

fork_ranks(worker, 2, out, layers, shape, warm_optimizers=False)
"""

# the writer (it forks its 3 ranks), then DeepSpeed's own zero_to_fp32 in the same process, so
# deepspeed is imported once
_ZERO3_WITH_REFERENCE = """
import os, runpy, sys
import torch
writer, root = sys.argv[1:3]
sys.argv = [writer, root]
runpy.run_path(writer, run_name="__main__")
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "z3"))
torch.save({k: v.detach() for k, v in sd.items()}, os.path.join(root, "zero_to_fp32.pt"))
"""


def _cli(capsys, *argv) -> str:
    code = main([*argv, "--quiet"] if argv[0] in ("import", "export") else list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def _inspect(capsys, path) -> dict:
    return json.loads(_cli(capsys, "inspect", path, "--json"))


def _bits(x) -> bytes:
    """The bytes of a tensor or array, for bit-for-bit comparisons (NaN payloads included)."""
    a = x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.ascontiguousarray(a).tobytes()


def _assert_same(got, ref, name) -> None:
    a = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    b = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, a.shape, b.dtype, b.shape)
    assert _bits(a) == _bits(b), name


def _safetensors(folder, prefix) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith(prefix) and f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as st:
                out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


def _dcp_to_torch(src, dst) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(src), str(dst))
    return torch.load(dst, weights_only=True)


def _no_config_anywhere(folder) -> None:
    for _, _, files in os.walk(folder):
        assert not {"config.json", "params.json"} & set(files)


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dcp_plain(tmp_path_factory):
    """16 plain tensors, `dcp.save(no_dist=True)`: (folder, {name: tensor})."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("agnostic") / "dcp"
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(*SHAPE, generator=g) for n in NAMES}
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    _no_config_anywhere(out)
    return str(out), sd


@pytest.fixture(scope="module")
def dcp_optim(tmp_path_factory):
    """The 16 tensors with an optimizer-like state as get_state_dict flattens it:
    `optim.state.<name>.exp_avg` / `exp_avg_sq` / `step`."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path_factory.mktemp("agnostic") / "dcp_optim"
    g = torch.Generator().manual_seed(1)
    sd = {n: torch.randn(*SHAPE, generator=g) for n in NAMES}
    for n in NAMES:
        sd[f"optim.state.{n}.exp_avg"] = torch.randn(*SHAPE, generator=g) * 1e-3
        sd[f"optim.state.{n}.exp_avg_sq"] = torch.rand(*SHAPE, generator=g) * 1e-6
        sd[f"optim.state.{n}.step"] = torch.tensor(float(STEP))
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    return str(out), sd


def _start_dcp_ranks(out) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _RANKS_WRITER, TESTS, str(out), str(LAYERS), *map(str, SHAPE)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _start_zero3(root) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "DS_WRITER_VARIANTS": "z3"}
    return subprocess.Popen(
        [sys.executable, "-c", _ZERO3_WITH_REFERENCE, DS_WRITER, str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def _wait(p: subprocess.Popen) -> None:
    try:
        _, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode == 0, err[-4000:]


@pytest.fixture(scope="module", autouse=True)
def writers(tmp_path_factory):
    """The two writers that start processes run in the background while the in-process tests
    run (not under xdist, where a worker may run none of the tests that need them)."""
    started = {}
    if "PYTEST_XDIST_WORKER" not in os.environ:
        ranks, ds = tmp_path_factory.mktemp("agnostic") / "dcp_ranks", tmp_path_factory.mktemp("agnostic_ds")
        started = {"ranks": (ranks, _start_dcp_ranks(ranks)), "zero3": (ds, _start_zero3(ds))}
    yield started
    for _, p in started.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def dcp_ranks(tmp_path_factory, writers):
    """The 16 names saved by 2 gloo ranks as DTensors (2 pieces each in 2 `.distcp` files)."""
    if "ranks" in writers:
        out, p = writers["ranks"]
    else:
        out = tmp_path_factory.mktemp("agnostic") / "dcp_ranks"
        p = _start_dcp_ranks(out)
    _wait(p)
    return str(out)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, writers):
    """DeepSpeed ZeRO-3 (fp32 + AdamW, 3 ranks, no config), DeepSpeed's own zero_to_fp32 of it,
    and the writer's reference (DeepSpeed's gather API)."""
    if "zero3" in writers:
        root, p = writers["zero3"]
    else:
        root = tmp_path_factory.mktemp("agnostic_ds")
        p = _start_zero3(root)
    _wait(p)
    src = str(root / "z3")
    _no_config_anywhere(src)
    return src, torch.load(root / "zero_to_fp32.pt", weights_only=True), load_reference(root, "z3")[0]


# -- DCP: inspect and export ----------------------------------------------------------------------


def test_dcp_inspect_lists_every_tensor(capsys, dcp_plain):
    src, _ = dcp_plain
    info = _inspect(capsys, src)
    assert info["format"] == "dcp" and info["needs_config"] and info["config"] is None
    assert [(t["name"], tuple(t["shape"]), t["dtype"]) for t in info["tensors"]] == [
        (n, SHAPE, "float32") for n in NAMES
    ]
    assert all(t["pieces"] == 1 for t in info["tensors"])  # no_dist: one rank, one piece each


def test_dcp_export_equals_dcp_to_torch_save(tmp_path, capsys, dcp_plain):
    _export_equals_torch(tmp_path, capsys, dcp_plain[0])
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert all(torch.equal(ref[k], dcp_plain[1][k]) for k in NAMES)  # torch's are what was saved


def _export_equals_torch(tmp_path, capsys, src) -> None:
    out = tmp_path / "out"
    _cli(capsys, "export", src, str(out))
    assert not (out / "config.json").exists()
    ref = _dcp_to_torch(src, tmp_path / "ref.pt")
    got = _safetensors(out, "model")
    assert sorted(got) == sorted(ref) == sorted(NAMES)
    for k in NAMES:
        _assert_same(got[k], ref[k], k)


def test_dcp_export_optimizer_moments(tmp_path, capsys, dcp_optim):
    src, sd = dcp_optim
    info = _inspect(capsys, src)
    assert sorted(t["name"] for t in info["tensors"]) == sorted(NAMES)
    assert info["optimizer"]["slots"] == ["exp_avg", "exp_avg_sq"] and info["optimizer"]["step"] == STEP
    out = tmp_path / "out"
    _cli(capsys, "export", src, str(out), "--optimizer")
    ref = _dcp_to_torch(src, tmp_path / "ref.pt")
    model, opt = _safetensors(out, "model"), _safetensors(out, "optimizer")
    assert sorted(model) == sorted(NAMES)
    for k in NAMES:
        _assert_same(model[k], ref[k], k)
        for slot in ("exp_avg", "exp_avg_sq"):
            _assert_same(opt[f"{k}.{slot}"], ref[f"optim.state.{k}.{slot}"], (k, slot))
    assert sorted(opt) == sorted([f"{k}.{s}" for k in NAMES for s in ("exp_avg", "exp_avg_sq")] + ["step"])
    assert int(opt["step"]) == int(ref[f"optim.state.{NAMES[0]}.step"]) == STEP


# -- DCP: import, restore onto other meshes ---------------------------------------------------------


def _meshes() -> tuple[str, list[str], str]:
    """(mesh to import onto, three other meshes to restore onto, a second import mesh), adapted
    to the devices present (8 simulated on CPU; a single GPU still checks import -> restore
    bitwise, on the one mesh it has)."""
    n = jax.device_count()
    if n >= 8:
        return "fsdp=2,tp=2", ["dp=1", "fsdp=4,tp=2", "tp=8"], "fsdp=8"
    if n >= 4:
        return "fsdp=2,tp=2", ["dp=1", "fsdp=4", "tp=2"], "tp=4"
    if n >= 2:
        return "fsdp=2", ["dp=1", "tp=2", "dp=2"], "tp=2"
    return "dp=1", ["dp=1"], "dp=1"


def _local_shape(mesh: str, spec) -> tuple[int, ...]:
    """The shape of one device's shard of a SHAPE tensor under `spec` on `mesh`."""
    sizes = MeshShape.parse(mesh).as_dict()
    return tuple(n // (sizes[a] if a else 1) for n, a in zip(SHAPE, (tuple(spec) + (None,) * len(SHAPE))[: len(SHAPE)], strict=True))


# the generic rule on [64, 32]: fsdp takes the largest dim it divides, tp the largest left
EXPECTED_SPEC = {
    "dp=1": P(None, None), "fsdp=2,tp=2": P("fsdp", "tp"), "fsdp=4,tp=2": P("fsdp", "tp"),
    "tp=8": P("tp", None), "fsdp=8": P("fsdp", None), "fsdp=4": P("fsdp", None), "tp=4": P("tp", None),
    "tp=2": P("tp", None), "fsdp=2": P("fsdp", None), "dp=2": P(None, None),
}


def _leaf(tree, name):
    for part in name.split("."):
        tree = tree[part]
    return tree


def _restore(ckpt, mesh):
    from hybridckpt.jobs.restore import restore

    cfg, r = restore(ckpt, mesh)
    assert cfg is None
    return r


def test_import_restores_onto_other_meshes_bitwise(tmp_path, capsys, dcp_optim):
    from hybridckpt import plan

    src, sd = dcp_optim
    first, others, second = _meshes()
    ckpt = str(tmp_path / "ckpt")
    out = _cli(capsys, "import", src, ckpt, "--mesh", first)
    assert "with optimizer state" in out and "generic rule" in out
    restored = {}
    for mesh in [first, *others]:
        r = restored[mesh] = _restore(ckpt, mesh)
        assert r.step == STEP
        mu, nu = r.opt_state[0].mu, r.opt_state[0].nu
        assert int(r.opt_state[0].count) == STEP
        for k in NAMES:
            leaf = _leaf(r.params, k)
            _assert_same(leaf, sd[k], (mesh, k))
            _assert_same(_leaf(mu, k), sd[f"optim.state.{k}.exp_avg"], (mesh, "mu", k))
            _assert_same(_leaf(nu, k), sd[f"optim.state.{k}.exp_avg_sq"], (mesh, "nu", k))
            # the generic rule, as a literal spec (and the moments sharded like their param)
            assert leaf.sharding.spec == EXPECTED_SPEC[mesh] == plan.generic_spec(SHAPE, leaf.sharding.mesh)
            assert _leaf(mu, k).sharding.spec == leaf.sharding.spec
            assert leaf.sharding.mesh.devices.size == MeshShape.parse(mesh).size
    # each restore really reshards: every device holds the shard its mesh's rule gives it (on 8
    # devices the four meshes give four different local shapes)
    for mesh, r in restored.items():
        shard = _leaf(r.params, NAMES[0]).addressable_shards[0].data.shape
        assert shard == _local_shape(mesh, EXPECTED_SPEC[mesh]), (mesh, shard)
    if jax.device_count() >= 8:
        assert len({_leaf(r.params, NAMES[0]).addressable_shards[0].data.shape for r in restored.values()}) == 4
    # the rule shards: on a mesh with fsdp or tp, no tensor is whole on a device
    for mesh in [first, *others]:
        sizes = MeshShape.parse(mesh).as_dict()
        if sizes["fsdp"] * sizes["tp"] == 1:
            continue
        leaf = _leaf(restored[mesh].params, NAMES[0])
        assert not leaf.sharding.is_fully_replicated
        assert leaf.addressable_shards[0].data.size < leaf.size
    # a second import onto a different mesh restores the same bits
    ckpt2 = str(tmp_path / "ckpt2")
    from hybridckpt.jobs import import_checkpoint

    s = import_checkpoint(src, ckpt2, mesh=second)
    assert s.with_optimizer and s.tensors == 3 * LAYERS  # params, exp_avg, exp_avg_sq
    r2 = _restore(ckpt2, first)
    for k in NAMES:
        a, b = _leaf(r2.params, k), _leaf(restored[first].params, k)
        assert a.sharding.spec == b.sharding.spec
        _assert_same(a, b, k)


# -- DCP saved by 2 ranks: tensors in pieces ---------------------------------------------------------


def test_dcp_ranks_inspect_shows_the_pieces(capsys, dcp_ranks):
    info = _inspect(capsys, dcp_ranks)
    assert sorted(t["name"] for t in info["tensors"]) == sorted(NAMES)
    assert all(t["pieces"] == 2 and tuple(t["shape"]) == SHAPE for t in info["tensors"])


def test_dcp_ranks_export_equals_dcp_to_torch_save(tmp_path, capsys, dcp_ranks):
    _export_equals_torch(tmp_path, capsys, dcp_ranks)


# -- DeepSpeed ZeRO-3 ---------------------------------------------------------------------------------


def test_zero3_export_equals_zero_to_fp32(tmp_path, capsys, zero3):
    src, ref, writer_ref = zero3
    info = _inspect(capsys, src)
    assert info["format"] == "deepspeed" and info["needs_config"]
    assert sorted(t["name"] for t in info["tensors"]) == sorted(ref)
    assert all(t["pieces"] > 1 for t in info["tensors"])  # every tensor split over the 3 ranks
    out = tmp_path / "out"
    _cli(capsys, "export", src, str(out), "--optimizer")
    assert not (out / "config.json").exists()
    got = _safetensors(out, "model")
    assert sorted(got) == sorted(ref)
    for k in ref:
        _assert_same(got[k], ref[k], k)
    # the moments, against DeepSpeed's gather API (safe_get_full_optimizer_state)
    opt = _safetensors(out, "optimizer")
    trainable = [k[len("exp_avg/"):] for k in writer_ref.files if k.startswith("exp_avg/")]
    assert trainable
    for k in trainable:
        for slot in ("exp_avg", "exp_avg_sq"):
            _assert_same(opt[f"{k}.{slot}"], writer_ref[f"{slot}/{k}"], (k, slot))
    assert int(opt["step"]) == 3


# -- ColossalAI ------------------------------------------------------------------------------------


def test_colossal_without_config_lists_and_consolidates(tmp_path, capsys):
    ref = pw.reference_llama(5, vocab=64)  # split evenly over tp: the tool refuses a padded vocab
    src = str(tmp_path / "colossal")
    cw.write_colossal(src, ref.params, layers=2, tp=2, pp=2, safetensors=True)
    _no_config_anywhere(src)
    info = _inspect(capsys, src)
    assert info["format"] == "colossal" and info["needs_config"]
    listed = {t["name"]: t for t in info["tensors"]}
    assert sorted(listed) == sorted(ref.params)
    assert listed["lm_head.weight"]["pieces"] == 2 and listed["lm_head.weight"]["shape"] == [64, 32]
    out = tmp_path / "out"
    _cli(capsys, "export", src, str(out))
    got = _safetensors(out, "model")
    assert sorted(got) == sorted(ref.params)
    for k, v in ref.params.items():
        _assert_same(got[k], v, k)


def test_optimizer_state_that_does_not_match_the_params_is_one_line(tmp_path, capsys):
    """A param without state (frozen), with no model config to say what it means: refused in one
    line naming the slot and the param, nothing written; --params-only imports the weights."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "partial"
    a, b = torch.ones(4, 2), torch.zeros(6)
    state = {"exp_avg": torch.full((4, 2), 0.5), "exp_avg_sq": torch.full((4, 2), 0.25), "step": torch.tensor(3.0)}
    dcp.save({"model": {"a": a, "b": b}, "optim": {"state": {"a": state}, "param_groups": [{"lr": 0.1, "params": ["a"]}]}},
             checkpoint_id=str(src), no_dist=True)
    assert main(["import", str(src), str(tmp_path / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "optimizer slot" in err and "no state for params ['b']" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
    assert main(["import", str(src), str(tmp_path / "y"), "--params-only", "--quiet"]) == 0
