"""Multi-host import: 2 local processes under jax.distributed, each reading only the byte ranges of
its own devices, writing one Orbax checkpoint that restores elsewhere.

Each process gets half of this session's devices (`_split`): on 8 simulated CPU devices 2 x 4 CPU
devices (gloo), on 4 GPUs 2 x 2 GPUs (CUDA_VISIBLE_DEVICES); with one device in this session each
process gets one simulated CPU device (two hosts of one device each: one GPU cannot be given to
two processes)."""

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from fixtures.torch_common import free_port
from meshes import fit, fit_mesh

from hybridckpt import jobs, models, naming
from hybridckpt.cli import main
from hybridckpt.formats.hf.write import write_hf
from hybridckpt.lazy import ArrayTensor
from hybridckpt.mesh import tree_shardings
from hybridckpt.plan import abstract_tree
from hybridckpt.store import CheckpointStore, read_trainer_state

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """An HF Llama whose bytes are dominated by sharded tensors (norms are a tiny fraction)."""
    cfg = models.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                             num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(7)
    flat = {k: ArrayTensor(rng.standard_normal(s.shape).astype(np.float32))
            for k, s in naming.flatten(models.param_shapes(cfg)).items()}
    hf = naming.model_rules(cfg).invert().apply_unstack(flat).tensors
    d = str(tmp_path_factory.mktemp("mp") / "src")
    write_hf(d, hf, models.config_to_hf(cfg))
    return d, hf


def _split() -> tuple[str, int, list[str] | None]:
    """(JAX_PLATFORMS, devices per process, the GPU ids to split or None) for 2 processes: half of
    this session's devices each, on their platform; one CPU device each where there is one device."""
    n = jax.device_count()
    if jax.devices()[0].platform == "cpu" or n == 1:
        return "cpu", max(1, n // 2), None
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = given.split(",") if given else [str(i) for i in range(n)]
    return os.environ["JAX_PLATFORMS"], n // 2, visible[:n]


def _run_two(src, dst, tmp_path, mesh, touch=None, config=None, restore=None):
    """Run the 2-process import of `src` into `dst` (then, given `restore`, both processes restore
    it onto that mesh); (exit codes, reports, logs, local devices, platform)."""
    port = free_port()
    platforms, local, visible = _split()
    platform = "cpu" if platforms == "cpu" else jax.devices()[0].platform
    mesh = fit(mesh, 2 * local)
    procs, outs = [], []
    for pid in range(2):
        out = str(tmp_path / f"p{pid}.json")
        outs.append(out)
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "HYBRIDCKPT_TEST_TOUCH")}
        if config is not None:
            env["HYBRIDCKPT_TEST_CONFIG"] = config
        if restore is not None:
            env["HYBRIDCKPT_TEST_RESTORE"] = fit(restore, 2 * local)
        if touch is not None:
            env["HYBRIDCKPT_TEST_TOUCH"], env["HYBRIDCKPT_TEST_FLAG"] = touch, str(tmp_path / "touched")
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[pid * local:(pid + 1) * local])
        procs.append(subprocess.Popen(
            [sys.executable, WORKER, str(pid), str(port), src, dst, mesh, out, platforms, str(local)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    reports = [json.load(open(o)) if os.path.exists(o) else None for o in outs]
    return [p.returncode for p in procs], reports, logs, local, platform


def test_two_process_import_reads_own_shards_and_restores_on_one_process(source, tmp_path, capsys):
    src, hf = source
    dst = str(tmp_path / "ckpt")
    codes, reports, logs, local, platform = _run_two(src, dst, tmp_path, "fsdp=2,tp=2,pp=2")
    assert codes == [0, 0], "\n".join(x[-3000:] for x in logs)
    assert [(r["local_devices"], r["platform"]) for r in reports] == [(local, platform)] * 2
    total = sum(t.nbytes for t in hf.values())
    for r in reports:
        read = sum(r["bytes_read"].values())
        assert 0 < read <= 0.55 * total, (read, total)
    # one checkpoint, restored by this single process onto another mesh: bitwise the source
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt")]
    cfg = jobs.open_checkpoint(src).config
    shapes = models.param_shapes(cfg)
    mesh = fit_mesh("tp=4,pp=2")
    with CheckpointStore(dst) as store:
        r = store.restore(target_params=abstract_tree(shapes, tree_shardings(shapes, models.logical_axes(cfg), mesh)))
    back = naming.tree_to_hf(jax.tree.map(np.asarray, r.params), cfg)
    for k, t in hf.items():
        np.testing.assert_array_equal(back[k].materialize(), t.materialize())
    # the checksums the two processes recorded together verify from one process
    assert main(["verify", dst]) == 0
    assert "arrays match their import checksums" in capsys.readouterr().out


def test_two_processes_restore_each_its_own_shards_exactly(source, tmp_path):
    """Both processes restore the store they wrote onto another mesh over all their devices
    (`store.chunk_fill`): every shard of each process is the source's slice bit for bit, and each
    reads exactly the stored chunks its own shards meet, each once and whole (a chunk both
    processes' shards meet, both read: its CRC-32 is the whole chunk's)."""
    src, hf = source
    dst = str(tmp_path / "ckpt")
    codes, reports, logs, local, _ = _run_two(src, dst, tmp_path, "fsdp=2,tp=2,pp=2", restore="fsdp=4,tp=2")
    assert codes == [0, 0], "\n".join(x[-3000:] for x in logs)
    cfg = jobs.open_checkpoint(src).config
    flat = naming.model_rules(cfg).apply(hf, strict=True).tensors  # (tree path -> the source tensor, layers stacked)
    grids = read_trainer_state(dst)["checksum_chunks"]
    seen = set()
    for r in reports:
        met = 0  # bytes of the stored chunks this process's shards meet: each read once, whole
        for key, shards in r["restored"].items():
            full = np.ascontiguousarray(flat[key].materialize())
            chunk = grids[f"params.{key}"]
            touched = set()
            for index, digest in shards:
                index = [(a, n if b is None else b) for (a, b), n in zip(index, full.shape, strict=True)]
                part = np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)])
                assert hashlib.sha256(part.tobytes()).hexdigest() == digest, (key, index)
                touched.update(itertools.product(*[range(a // c, -(-b // c)) for (a, b), c in zip(index, chunk, strict=True)]))
                seen.add(key)
            for idx in touched:
                met += int(np.prod([min(n, (i + 1) * c) - i * c for i, c, n in zip(idx, chunk, full.shape, strict=True)])) * full.itemsize
        assert r["restore_read"] == met, (r["restore_read"], met)
    assert seen == set(flat)


def test_a_source_file_changed_under_process_1_alone_commits_nothing(tmp_path):
    """Process 0 commits, but each process reads (and records as it first saw it) its own files.
    Here a `.distcp` both read changes (its mtime, as a rewrite in place leaves it) after process 1
    first opened it and before process 0 did: process 0 sees one consistent file; only process 1
    can tell. Each process checks its own reads before the commit and they agree
    (`store.save._agree_sources_unchanged`): one line from each process, nothing committed.
    Before, process 0 committed it."""
    case = os.path.join(os.path.dirname(__file__), "..", "real", "cases", "torchtitan_llama3")
    src, config = str(tmp_path / "src"), os.path.join(case, "config.json")
    shutil.copytree(os.path.join(case, "ckpt"), src)
    touched = os.path.join(src, "step-3", "__1_0.distcp")
    dst = tmp_path / "ckpt"
    codes, reports, logs, *_ = _run_two(src, str(dst), tmp_path, "fsdp=2,tp=2,pp=2", touch=touched, config=config)
    assert [r["touch_order_ok"] for r in reports] == [True, True], "\n".join(x[-3000:] for x in logs)
    assert codes == [3, 3], "\n".join(x[-3000:] for x in logs)
    assert f"{touched} changed while it was read" in reports[1]["error"], reports[1]["error"]
    assert "not committed: a source file read by process 1 changed" in reports[0]["error"], reports[0]["error"]
    assert all("\n" not in r["error"] for r in reports)
    assert not dst.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".ckpt")]
