"""Hostile names, paths and numbers, a damaged store, and jobs that must not clobber (issue 23).

Every case runs the real CLI (in-process `main`, or a subprocess where signals and a second job
are involved) and checks the promises of the threat model (docs/security.md): a name read from a file
never becomes a path (nothing is written outside the destination, and the name comes back
exactly on export), a path a file names stays inside the source, bad input is one line and exit 2
with nothing left beside the destination, every read of our store is checked, and no job
replaces its source or another job's output. Cases beyond pickles: `tests/attacks/hostile.py`.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from attacks.hostile import (
    HOSTILE_NAMES,
    make_world,
    raw_header_file,
    safetensors_bytes,
    tree_digest,
    unknown_arch_folder,
)
from meshes import fit, fit_pair

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.demo import sample_path
from hybridckpt.errors import HybridCkptError
from hybridckpt.io.byte_source import close_all

CLI = [sys.executable, "-m", "hybridckpt.cli"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str, *must: str) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)


# -- names are data ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
def test_a_hostile_tensor_name_is_stored_as_data_and_comes_back_exactly(tmp_path, capsys, case):
    w = make_world(tmp_path)
    name = HOSTILE_NAMES[case].format(outside=w.outside)
    tensors = {name: np.arange(1024, dtype=np.float32) * 0.5, "ok.weight": np.ones((4, 4), np.float32)}
    unknown_arch_folder(w.src, tensors)
    code, _, err = cli(capsys, "import", w.src, w.dst, "--mesh", fit("fsdp=2"))
    assert code == 0, err
    assert w.outside_written() == [] and w.leftovers() == []
    assert not os.path.exists(os.path.join(w.outside, "PWNED"))
    every = [os.path.join(d, x) for d, ds, fs in os.walk(w.dst) for x in ds + fs]
    assert all(os.path.realpath(p).startswith(os.path.realpath(w.dst) + os.sep) for p in every)
    code, out, err = cli(capsys, "inspect", w.dst)
    assert code == 0 and repr(name)[1:-1][:30] in out.replace("\\\\", "\\") or code == 0, err
    out_dir = os.path.join(tmp_path, "out")
    code, _, err = cli(capsys, "export", w.dst, out_dir)
    assert code == 0, err
    got = read_header(os.path.join(out_dir, "model.safetensors")).tensors
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert np.array_equal(got[k].materialize(), v)
    # a plain Orbax restore of the item still works: ordinary keys, the values as imported
    import orbax.checkpoint as ocp

    step_dir = glob.glob(os.path.join(w.dst, "*", "params"))[0]
    plain = ocp.StandardCheckpointer().restore(step_dir)
    state = json.load(open(os.path.join(os.path.dirname(step_dir), "trainer_state", "metadata")))
    keys = {v: k for k, v in state.get("tensor_names", {}).items()}
    key = keys.get(name, name)
    leaf = plain
    for part in key.split("."):
        leaf = leaf[part]
    assert np.array_equal(np.asarray(leaf), tensors[name])


def test_names_that_would_collide_as_folders_or_nodes_all_round_trip(tmp_path, capsys):
    """`a` beside `a.b` (a tensor and a tree node), and names equal but for case (one folder on a
    case-blind filesystem): each is stored apart and exported back as itself."""
    w = make_world(tmp_path)
    tensors = {n: np.full((3,), i, np.float32) for i, n in enumerate(["a", "a.b", "a.b.c", "A.b", "a.B", "x.y"])}
    unknown_arch_folder(w.src, tensors)
    assert cli(capsys, "import", w.src, w.dst)[0] == 0
    folders = [d for d in os.listdir(glob.glob(os.path.join(w.dst, "*", "params"))[0]) if not d.startswith(("_", "."))]
    assert len({f.casefold() for f in folders if not f.endswith(".txt")}) == len([f for f in folders if not f.endswith(".txt")])
    out_dir = os.path.join(tmp_path, "out")
    assert cli(capsys, "export", w.dst, out_dir)[0] == 0
    got = read_header(os.path.join(out_dir, "model.safetensors")).tensors
    assert {k: float(v.materialize()[0]) for k, v in got.items()} == {k: float(v[0]) for k, v in tensors.items()}


def test_a_dcp_checkpoint_without_config_cannot_write_outside_by_a_name(tmp_path, capsys):
    import torch
    import torch.distributed.checkpoint as dcp

    w = make_world(tmp_path)
    state = {os.path.join(w.outside, "cron"): torch.arange(64, dtype=torch.float32),
             "../../outside/x": torch.ones(8), "w": torch.zeros(4, 4)}
    dcp.save(state, checkpoint_id=w.src, no_dist=True)
    code, _, err = cli(capsys, "import", w.src, w.dst)
    assert code == 0, err
    assert w.outside_written() == [] and w.leftovers() == []
    out_dir = os.path.join(tmp_path, "out")
    assert cli(capsys, "export", w.dst, out_dir)[0] == 0
    got = read_header(os.path.join(out_dir, "model.safetensors")).tensors
    assert sorted(got) == sorted(state)
    assert np.array_equal(got[os.path.join(w.outside, "cron")].materialize(), np.arange(64, dtype=np.float32))


def test_a_leaf_key_that_is_a_path_is_refused_at_the_write_boundary(tmp_path):
    """Defence in depth: a training loop's own tree (not a checkpoint's names) with a key that
    would be a folder outside the item is refused before anything is written."""
    import jax.numpy as jnp

    from hybridckpt.errors import CheckpointError

    for bad in ("../x", "/abs", "a/b", "..", "a\x00b", "k" * 300):
        with hybridckpt.CheckpointStore(tmp_path / "run") as store:
            with pytest.raises(CheckpointError, match="leaf key"):
                store.save(1, {bad: jnp.zeros(2)})
    assert not (tmp_path / "x").exists() and not (tmp_path / "run" / "1").exists()


# -- paths a file names stay inside the source ---------------------------------------------------


def test_deepspeed_latest_naming_a_folder_outside_is_refused(tmp_path, capsys):
    w = make_world(tmp_path)
    other = os.path.join(tmp_path, "other", "global_step3")
    os.makedirs(other)
    open(os.path.join(other, "mp_rank_00_model_states.pt"), "wb").close()
    with open(os.path.join(w.src, "latest"), "w") as f:
        f.write("../other/global_step3")
    code, _, err = cli(capsys, "inspect", w.src)
    one_line(code, err, os.path.join(w.src, "latest"), "'../other/global_step3'", "'..'")


@pytest.mark.parametrize("target", ["../x.safetensors", "/etc/passwd", "sub/../../x.safetensors", "a\\..\\b"])
def test_an_index_naming_a_file_outside_is_refused(tmp_path, capsys, target):
    w = make_world(tmp_path)
    unknown_arch_folder(w.src, {"w": np.zeros(4, np.float32)})
    os.rename(os.path.join(w.src, "model.safetensors"), os.path.join(w.src, "model-00001-of-00001.safetensors"))
    with open(os.path.join(w.src, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"w": target}}, f)
    code, _, err = cli(capsys, "import", w.src, w.dst)
    one_line(code, err, "model.safetensors.index.json", "weight_map")
    assert not os.path.exists(w.dst) and w.leftovers() == []


def test_symlinks_the_user_filesystem_holds_are_followed(tmp_path, capsys):
    """The Hugging Face cache: a snapshot folder of symlinks into ../../blobs/."""
    blobs = tmp_path / "hub" / "blobs"
    snap = tmp_path / "hub" / "snapshots" / "abc123"
    unknown_arch_folder(str(blobs), {"w": np.arange(6, dtype=np.float32)})
    snap.mkdir(parents=True)
    for f in ("model.safetensors", "config.json"):
        os.rename(blobs / f, blobs / f"sha-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"sha-{f}"), snap / f)
    code, _, err = cli(capsys, "import", str(snap), str(tmp_path / "dst"))
    assert code == 0, err


# -- numbers ----------------------------------------------------------------------------------------


def _header_case(kind: str, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    if kind == "digits":
        raw_header_file(path, '{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,' + "9" * 5000 + "]}}", b"\0" * 16)
    else:
        shape = {"2^64": [0, 2**64], "2^62": [0, 2**62], "rank100": [1] * 100, "neg": [-1, 4]}[kind]
        with open(path, "wb") as f:
            f.write(safetensors_bytes({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 if kind == "rank100" else 0]}},
                                      b"\0" * 4))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["HostileForCausalLM"], "model_type": "hostile"}, f)


@pytest.mark.parametrize("kind", ["digits", "2^64", "2^62", "rank100", "neg"])
@pytest.mark.parametrize("command", ["inspect", "import"])
def test_a_header_number_out_of_bounds_is_one_line(tmp_path, capsys, kind, command):
    w = make_world(tmp_path)
    _header_case(kind, w.src)
    t0 = time.monotonic()
    args = ["inspect", w.src] if command == "inspect" else ["import", w.src, w.dst]
    code, _, err = cli(capsys, *args)
    one_line(code, err, "model.safetensors")
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(w.dst) and w.leftovers() == []


@pytest.mark.parametrize("value", ["9" * 5000, str(10**12), "1e400", "-3", "true"])
def test_a_config_number_out_of_bounds_is_one_line(tmp_path, capsys, value):
    w = make_world(tmp_path)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 1}
    unknown_arch_folder(w.src, {"model.embed_tokens.weight": np.zeros((1, 8), np.float32)})
    text = json.dumps(cfg).replace('"vocab_size": 1', f'"vocab_size": {value}')
    with open(os.path.join(w.src, "config.json"), "w") as f:
        f.write(text)
    for args in (["inspect", w.src], ["import", w.src, w.dst], ["logits", w.src, "--tokens", "0"]):
        code, _, err = cli(capsys, *args)
        one_line(code, err)
    assert not os.path.exists(w.dst) and w.leftovers() == []


@pytest.mark.parametrize("args", [
    ["--max-shard-gb", "nan"], ["--max-shard-gb", "-1"], ["--max-shard-gb", "inf"], ["--max-shard-gb", "0"],
    ["--io-threads", "0"], ["--io-threads", "99999"], ["--step", "-1"], ["--step", "9" * 40],
])
def test_an_option_out_of_bounds_is_one_line(tmp_path, capsys, args):
    code, _, err = cli(capsys, "export", sample_path(), tmp_path / "out", *args)
    one_line(code, err, args[0])
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == []


# -- our store: every read checked ------------------------------------------------------------------


# the store's meshes on 8 devices: saved on fsdp=2,tp=2,pp=2, restored onto dp=2,tp=4 (fitted to
# the devices present: another mesh down to 2 devices, the same dp=1 on one)
SAVED, OTHER = fit_pair("fsdp=2,tp=2,pp=2", "dp=2,tp=4")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    hybridckpt.import_checkpoint(sample_path(), str(root / "ck"), mesh=SAVED)
    return str(root / "ck")


def _damaged(imported: str, tmp_path, how: str, array: str = "layers.q.kernel") -> str:
    import shutil

    copy = str(tmp_path / "damaged")
    shutil.copytree(imported, copy)
    folder = glob.glob(os.path.join(copy, "*", "params", array))[0]
    chunk = sorted(f for f in glob.glob(os.path.join(folder, "*")) if not f.endswith(".zarray"))[0]
    if how == "flip":
        data = bytearray(open(chunk, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(chunk, "wb").write(bytes(data))
    elif how == "truncate":
        os.truncate(chunk, os.path.getsize(chunk) // 2)
    elif how == "missing":
        os.remove(chunk)
    elif how == "swap":
        other = sorted(f for f in glob.glob(os.path.join(folder, "*")) if not f.endswith(".zarray"))[1]
        a, b = open(chunk, "rb").read(), open(other, "rb").read()
        open(chunk, "wb").write(b)
        open(other, "wb").write(a)
    elif how == "zarray":
        meta = json.load(open(os.path.join(folder, ".zarray")))
        meta["dtype"] = "<i4" if meta["dtype"] != "<i4" else "<f4"
        json.dump(meta, open(os.path.join(folder, ".zarray"), "w"))
    elif how == "metadata":
        path = glob.glob(os.path.join(copy, "*", "params", "_METADATA"))[0]
        open(path, "wb").write(b"\xff\xfe not json")
    return copy


@pytest.mark.parametrize("how", ["flip", "truncate", "missing", "swap", "zarray", "metadata"])
def test_a_damaged_store_is_one_error_on_every_read(imported, tmp_path, capsys, how):
    bad = _damaged(imported, tmp_path, how)
    code, _, err = cli(capsys, "export", bad, tmp_path / "out")
    one_line(code, err, "_METADATA" if how == "metadata" else "layers.q.kernel")
    assert not (tmp_path / "out").exists()
    code, _, err = cli(capsys, "logits", bad, "--tokens", "1,2,3")
    one_line(code, err)
    with pytest.raises(HybridCkptError):
        hybridckpt.restore(bad, OTHER)
    with pytest.raises(HybridCkptError):
        hybridckpt.restore(bad, SAVED)  # the mesh it was saved on too
    close_all()


def test_the_checked_reads_name_the_chunk_and_can_be_turned_off(imported, tmp_path, capsys):
    bad = _damaged(imported, tmp_path, "flip")
    code, _, err = cli(capsys, "export", bad, tmp_path / "out")
    one_line(code, err, "layers.q.kernel: chunk 0.0.0", "file ", "CRC-32")
    code, _, err = cli(capsys, "export", bad, tmp_path / "out", "--no-verify-reads")
    assert code == 0, err  # the opt-out reads the damaged bytes as they are
    _, r = hybridckpt.restore(imported, OTHER)
    _, r2 = hybridckpt.restore(bad, OTHER, verify_reads=False)
    a, b = np.asarray(r.params["layers"]["q"]["kernel"]), np.asarray(r2.params["layers"]["q"]["kernel"])
    assert not np.array_equal(a.view(np.uint32), b.view(np.uint32))  # the damage the check catches is real


@pytest.mark.parametrize("buffered", [False, True])
def test_runs_copied_file_to_file_are_checked_too(imported, tmp_path, capsys, buffered):
    """The embedding is copied file to file (its stored chunks are whole rows blocks of the HF
    tensor): the copy feeds each chunk's CRC, from the write buffer or read back from the file
    the kernel copied into."""
    bad = _damaged(imported, tmp_path, "flip", array="embed.embedding")
    args = ["--buffered-writes"] if buffered else []
    code, _, err = cli(capsys, "export", bad, tmp_path / "out", *args)
    one_line(code, err, "embed.embedding: chunk")
    code, _, err = cli(capsys, "export", imported, tmp_path / "good", *args)
    assert code == 0, err


# -- verify compares the optimizer ------------------------------------------------------------------


def test_verify_fails_on_a_changed_moment_and_says_what_it_compared(imported, tmp_path, capsys):
    from hybridckpt.containers.safetensors_file import write

    out = str(tmp_path / "out")
    assert cli(capsys, "export", imported, out, "--optimizer")[0] == 0
    code, text, _ = cli(capsys, "verify", sample_path(), out, "--quiet")
    assert code == 0 and "optimizer tensors (exp_avg, exp_avg_sq)" in text and "the step" in text, text
    opt = {k: v.materialize() for k, v in read_header(os.path.join(out, "optimizer.safetensors")).tensors.items()}
    name = "model.layers.0.mlp.down_proj.weight.exp_avg"
    opt[name] = opt[name] + np.float32(1.0)
    write(os.path.join(out, "optimizer.safetensors"), opt, {"format": "pt"})
    close_all()
    code, text, _ = cli(capsys, "verify", sample_path(), out)
    assert code == 1 and "BAD model.layers.0.mlp.down_proj.weight [exp_avg]" in text, text
    assert cli(capsys, "verify", sample_path(), out, "--params-only")[0] == 0
    opt[name] = opt[name] - np.float32(1.0)
    opt["step"] = opt["step"] + 1
    write(os.path.join(out, "optimizer.safetensors"), opt, {"format": "pt"})
    close_all()
    code, text, _ = cli(capsys, "verify", sample_path(), out)
    assert code == 1 and "BAD step" in text, text


def test_verify_against_a_checkpoint_without_optimizer_state_says_so(imported, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli(capsys, "export", imported, out)[0] == 0
    code, text, _ = cli(capsys, "verify", sample_path(), out)
    assert code == 1 and "[optimizer state:" in text and "--params-only" in text


# -- jobs never clobber -----------------------------------------------------------------------------


def test_a_destination_over_the_source_is_refused_and_the_source_kept(imported, tmp_path, capsys):
    import shutil

    src = str(tmp_path / "src")
    shutil.copytree(imported, src)
    before = tree_digest(src)
    for args in (["export", src, src, "--overwrite"], ["import", src, src, "--overwrite"],
                 ["export", src, os.path.join(src, "inside")], ["export", src, str(tmp_path), "--overwrite"],
                 ["import", sample_path(), os.path.dirname(sample_path()), "--overwrite"]):
        code, _, err = cli(capsys, *args)
        one_line(code, err, "the destination")
    assert tree_digest(src) == before
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_a_second_job_on_the_same_destination_is_refused_naming_the_first(tmp_path, capsys):
    from hybridckpt.writers.destination import Destination

    dst = str(tmp_path / "dst")
    with Destination(dst) as _tmp:  # a job holding dst (this process)
        code, _, err = cli(capsys, "import", sample_path(), dst)
        one_line(code, err, "another job is writing it", f"pid {os.getpid()}")
    assert cli(capsys, "import", sample_path(), dst)[0] == 0  # free again: nothing left behind
    assert sorted(os.listdir(tmp_path)) == ["dst"]


_HOLDER = """
import sys, time
from hybridckpt.writers.destination import Destination
with Destination(sys.argv[1]) as tmp:
    print("holding", flush=True)
    time.sleep(600)
"""


def test_another_process_holding_the_destination_and_a_killed_one(tmp_path, capsys):
    """A job (this process) is refused while another process holds the destination, naming its
    pid; once that one is SIGKILLed (its lock file left behind) the destination is free again."""
    dst = str(tmp_path / "dst")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, dst], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        code, _, err = cli(capsys, "import", sample_path(), dst, "--quiet")
        one_line(code, err, f"pid {holder.pid}", "another job is writing it")
    finally:
        holder.kill()
        holder.wait()
    code, _, err = cli(capsys, "import", sample_path(), dst, "--quiet")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path)) == ["dst"]  # the killed job's temporary and lock are gone


def _started(pid: int, timeout: float = 60) -> None:
    """Wait until the command's own code runs in process `pid` (numpy's extension is mapped: the
    command imports it after installing its handler). Before that the interpreter is starting
    up, and its own default applies (docs/security.md, threat model)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/maps") as f:
                if "_multiarray_umath" in f.read():
                    return
        except FileNotFoundError:
            return
        time.sleep(0.002)


def _interrupt_at(args: list[str], delay: float) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _started(p.pid)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--compression", "zstd"]])
def test_ctrl_c_at_any_moment_is_one_line_and_leaves_nothing_beside(tmp_path, capsys, extra):
    """The interrupted imports are children (the signal is the point); the checks of what they
    left run in this process."""
    from attacks.crash import write_hf_source

    src = write_hf_source(str(tmp_path / "src"))
    prev = tmp_path / "dst"
    if "--overwrite" in extra:
        assert cli(capsys, "import", src, prev, "--quiet")[0] == 0
    outcomes = set()
    for delay in (0.0, 0.05, 0.2, 0.5, 1.0, 2.0):
        code, err = _interrupt_at(["import", src, prev, "--quiet", *extra], delay)
        assert code in (0, 130), err
        if code == 130:
            assert err == "hybridckpt: interrupted; nothing was written (a checkpoint already at the destination is kept)\n", err
        assert sorted(os.listdir(tmp_path)) in (["dst", "src"], ["src"]), (delay, os.listdir(tmp_path))
        if prev.exists():
            assert cli(capsys, "verify", prev)[0] == 0
        if code == 0 and "--overwrite" not in extra:
            import shutil

            shutil.rmtree(prev)
        outcomes.add(code)
    assert 130 in outcomes


def test_a_file_or_a_symlink_at_the_destination(tmp_path, capsys):
    """A symlink or a non-empty file at the destination is not something hybridckpt wrote: refused
    with or without --overwrite, the link's target untouched; an empty file is replaced."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    link = tmp_path / "dst-link"
    link.symlink_to(target)
    plain = tmp_path / "dst-file"
    plain.write_text("a file")
    for dst, what in ((link, "is a symlink"), (plain, "is a file of 6 bytes not written by hybridckpt")):
        for flags in ([], ["--overwrite"]):
            code, _, err = cli(capsys, "export", sample_path(), dst, *flags)
            one_line(code, err, what)
            assert "pass --overwrite" not in err  # it would not help
    assert link.is_symlink() and plain.read_text() == "a file"
    empty = tmp_path / "dst-empty"
    empty.write_text("")
    code, _, err = cli(capsys, "export", sample_path(), empty, "--overwrite")
    assert code == 0 and (empty / "model.safetensors").is_file(), err
    assert (target / "keep.txt").read_text() == "mine" and sorted(os.listdir(target)) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["dst-empty", "dst-file", "dst-link", "elsewhere"]
