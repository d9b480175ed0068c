"""Readers work in time and memory bounded by the bytes they are given (issue 38).

Hostile inputs are built here: pickles whose memo references expand to 10^10 objects
("billion laughs", written by torch.save itself); JSON nested past its depth limit in
copies of real checkpoints; ... Every check counts objects and bytes
(tracemalloc, the expansion count), never time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import attacks
import numpy as np
import pytest
import torch
from attacks import opcodes as op
from attacks.containers import CONTAINERS, LLAMA_CONFIG

from hybridckpt.cli import main
from hybridckpt.containers.pickle import torch_save
from hybridckpt.containers.pickle.budget import budget_for, expanded_size
from hybridckpt.errors import FormatError
from hybridckpt.io import json_text
from hybridckpt.io.byte_source import close_all
from hybridckpt.io.json_text import MAX_JSON_DEPTH, JsonTooDeep

# -- pickles: billion laughs -------------------------------------------------------------------


def _laughs(levels: int = 12) -> list:
    x = [0.1] * 10
    for _ in range(levels):
        x = [x] * 10  # one list, referenced 10 times: torch.save writes BINGETs of it
    return x


@pytest.mark.parametrize("legacy", [False, True])
def test_scheduler_pt_billion_laughs_is_refused_in_bounded_memory(tmp_path, legacy):
    """torch.save writes a scheduler state whose `last_lr` expands to 10^13 floats in ~400
    bytes of pickle: the load refuses it in one line naming the file, allocating little."""
    path = str(tmp_path / "scheduler.pt")
    torch.save({"last_lr": _laughs(), "base_lrs": [0.1]}, path, _use_new_zipfile_serialization=not legacy)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as e:
            torch_save.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        close_all()
    msg = str(e.value)
    assert msg.startswith(path) and "\n" not in msg
    # each list below the root is written once and fetched 9 more times; a fetch of the list k
    # levels above the floats adds its whole expansion: sum(10**j, j <= k) lists + 10**(k+1) floats
    added = 9 * sum(sum(10**j for j in range(k + 1)) + 10 ** (k + 1) for k in range(12))
    assert f"expands to at least {added} objects" in msg and "budget" in msg
    assert peak < 4 << 20, peak  # bytes: the shared graph only, never the expansion


def test_shared_lists_within_budget_load_with_their_values(tmp_path):
    """Sharing as real checkpoints use it (one list under several keys) still loads exactly."""
    path = str(tmp_path / "scheduler.pt")
    lrs = [0.25 * k for k in range(1000)]
    torch.save({"last_lr": lrs, "base_lrs": lrs, "groups": [lrs] * 100}, path)
    obj = torch_save.load(path)
    close_all()
    assert obj["last_lr"] == lrs and obj["base_lrs"] == lrs and obj["groups"] == [lrs] * 100
    assert obj["groups"][0] is obj["last_lr"]


def test_expanded_size_counts_every_reference_once_per_reference():
    leaf = ["ab", b"xyz", 1.5]  # 4 objects, 5 bytes
    mid = (leaf, leaf, leaf)  # 1 + 3 * 4 objects, 15 bytes
    root = {"k": mid, "j": [mid, leaf]}  # dict + "k" + mid + "j" + list + mid + leaf
    assert expanded_size(leaf) == (4, 5)
    assert expanded_size(mid) == (13, 15)
    assert expanded_size(root) == (1 + 1 + 13 + 1 + 1 + 13 + 4, 1 + 15 + 1 + 15 + 5)


def test_expanded_size_cycles_count_once_and_depth_does_not_recurse():
    a: list = [1]
    a.append(a)
    assert expanded_size(a) == (3, 0)
    deep: list = []
    for _ in range(200_000):
        deep = [deep]
    assert expanded_size(deep) == (200_001, 0)


def test_expansion_is_linear_in_distinct_objects():
    """10 levels of 10 references: 10^10 leaves counted by visiting 11 lists, not the leaves."""
    x = _laughs(10)
    objects, _ = expanded_size(x)
    assert objects == sum(10**k for k in range(11)) + 10**11  # lists + floats
    assert objects > budget_for(1 << 20).objects


def test_cli_megatron_args_billion_laughs_is_one_line(tmp_path, capsys):
    payload = next(p for p in attacks.PAYLOADS if p.name.startswith("billion laughs, the innermost"))
    path, file = CONTAINERS["megatron-args"].write(str(tmp_path), payload.build, str(tmp_path / "M"))
    capsys.readouterr()
    code = main(["inspect", path])
    err = capsys.readouterr().err
    close_all()
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    assert "model_optim_rng.pt" in err and "budget" in err


# -- JSON: nesting past the depth limit ---------------------------------------------------------

REAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real", "cases")


def _nested(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 100_000])
def test_json_nested_past_the_limit_is_one_line(depth):
    with pytest.raises(JsonTooDeep) as e:
        json_text.loads(_nested(depth), "f.json")
    assert str(e.value) == f"f.json: JSON nested deeper than {MAX_JSON_DEPTH} levels; not a file this format writes"


def test_json_at_the_limit_parses_with_its_values():
    value = json_text.loads(_nested(MAX_JSON_DEPTH), "f.json")
    for _ in range(MAX_JSON_DEPTH):
        value = value["a"]
    assert value == 1
    assert json_text.loads(b'[[1, 2], {"k": [3]}]', "g") == [[1, 2], {"k": [3]}]
    with pytest.raises(FormatError, match="^g: not valid JSON"):
        json_text.loads(b"[1,", "g")


def _copy_case(tmp_path, case: str) -> str:
    dst = str(tmp_path / case)
    shutil.copytree(os.path.join(REAL, case, "ckpt"), dst)
    return dst


def _deep_file(path: str, depth: int = 5000) -> None:
    os.chmod(path, 0o644) if os.path.exists(path) else None
    with open(path, "wb") as f:
        f.write(_nested(depth))


@pytest.mark.parametrize(
    "case, file",
    [
        ("megatron_core_dense_dp_reshardable", "iter_0000003/metadata.json"),
        ("maxtext_llama3", "4/items/_METADATA"),
        ("maxtext_llama3", "4/items/params.params.decoder.decoder_norm.scale/.zarray"),
    ],
)
def test_cli_deep_json_in_a_real_checkpoint_is_one_line(tmp_path, capsys, case, file):
    folder = _copy_case(tmp_path, case)
    _deep_file(os.path.join(folder, file))
    capsys.readouterr()
    config = ["--config", os.path.join(REAL, "torchtitan_llama3", "config.json")] if "maxtext" in case else []
    code = main(["inspect", folder, *config])
    err = capsys.readouterr().err
    close_all()
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    assert file.split("/")[-1] in err and "nested deeper than" in err, err


# -- YAML: alias and merge bombs ----------------------------------------------------------------


def _alias_bomb(levels: int = 11) -> str:
    """`a0` a list of 10 strings, each `a{i}` a list of 10 aliases of `a{i-1}`: 10^(levels+1)
    leaves in under 1 KB."""
    lines = ["a0: &a0 [" + ", ".join(["silu"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _merge_bomb(levels: int = 40) -> str:
    """Each mapping merges the previous one twice (`<<: [*m, *m]`): PyYAML copies the merged
    pairs, 2^levels of them, whatever the keys."""
    lines = ["m0: &m0 {x: 1}"]
    lines += [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}]}}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("bomb", ["alias", "merge"])
def test_bridge_run_config_yaml_bomb_is_one_line(tmp_path, capsys, bomb):
    """A Megatron-Bridge checkpoint whose run_config.yaml `activation_func` is an alias bomb (or
    whose `model:` merges a merge bomb): `inspect` is one line naming the file, in bounded memory."""
    import yaml
    from fixtures.megatron_dist_writer import write_torch_dist
    from fixtures.megatron_writer import make_llama

    ref = make_llama(hidden=64, layers=2, heads=8, kv_heads=4, ffn=96, vocab=100, seed=3)
    it_dir = write_torch_dist(str(tmp_path / "ckpt"), ref, tp=1, pp=1, layout="bridge")
    path = os.path.join(it_dir, "run_config.yaml")
    with open(path) as f:
        run = yaml.safe_load(f)
    model = yaml.safe_dump({"model": run["model"]}).replace("model:\n", "")
    if bomb == "alias":
        text = _alias_bomb() + "model:\n" + model.replace("  activation_func:", "  activation_func: *a11\n  old_act:")
    else:
        text = _merge_bomb() + "model:\n  <<: *m40\n" + model
    with open(path, "w") as f:
        f.write(text)
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = main(["inspect", str(tmp_path / "ckpt")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    assert "run_config.yaml" in err and "through its aliases and merge keys" in err, err
    assert peak < 64 << 20, peak


def test_yaml_aliases_within_the_budget_load_with_their_values(tmp_path):
    from hybridckpt.formats.megatron_dist.config import read_yaml

    path = tmp_path / "run_config.yaml"
    path.write_text("base: &b {num_layers: 2, hidden_size: 64}\nmodel:\n  <<: *b\n  ffn: [*b, *b]\n")
    assert read_yaml(str(path), "model") == {
        "num_layers": 2, "hidden_size": 64, "ffn": [{"num_layers": 2, "hidden_size": 64}] * 2
    }


# -- special files: FIFOs and devices are refused at open ---------------------------------------


def _cli_child(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a child (a FIFO would block an in-process open forever: the timeout fails it)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "hybridckpt.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def _special(path: str, kind: str) -> None:
    if os.path.exists(path):
        os.remove(path)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("file", ["model_state.pdparams", "model.safetensors", "config.json"])
def test_special_files_are_refused_in_one_line(tmp_path, kind, file):
    """A FIFO (or a link to /dev/zero) in place of a checkpoint file: `inspect` refuses it in one
    line naming the file, never waits on it (a FIFO named *.pdparams blocked forever)."""
    from hybridckpt.demo import sample_path

    if file.endswith(".pdparams"):
        folder = str(tmp_path / "paddle")
        os.makedirs(folder)
        path, _ = CONTAINERS["paddle-pdparams"].write(folder, lambda c: op.value([1]), str(tmp_path / "M"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(LLAMA_CONFIG, f)
        _special(path, kind)
        target = folder  # found by listing the folder, not by the path typed
    else:
        folder = str(tmp_path / "hf")
        shutil.copytree(sample_path(), folder)
        _special(os.path.join(folder, file), kind)
        target = folder
    r = _cli_child("inspect", target)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("hybridckpt: error:"), r.stderr
    # the HF folder's only weights file is not a file: no format claims the folder
    assert file in r.stderr or (file == "model.safetensors" and "not a checkpoint" in r.stderr), r.stderr


def test_open_regular_names_what_the_file_is(tmp_path):
    from hybridckpt.io.regular_file import NotRegular, open_regular

    fifo = str(tmp_path / "p")
    os.mkfifo(fifo)
    with pytest.raises(NotRegular, match=r"p: a FIFO \(named pipe\), not a regular file"):
        open_regular(fifo)
    with pytest.raises(NotRegular, match="a character device"):
        open_regular("/dev/null")
    with pytest.raises(NotRegular, match="a directory"):
        open_regular(str(tmp_path))
    plain = tmp_path / "f"
    plain.write_bytes(b"abc")
    fd = open_regular(str(plain))
    assert os.pread(fd, 3, 0) == b"abc"
    os.close(fd)


def test_byte_source_and_metadata_reads_refuse_a_fifo_without_waiting(tmp_path):
    """Every source read goes through `open_regular`: the byte-range reader (safetensors, DCP,
    torch.save files) and the metadata reader (JSON, trackers, YAML)."""
    from hybridckpt.io.byte_source import ByteSource
    from hybridckpt.io.config_file import read_bytes
    from hybridckpt.io.regular_file import NotRegular

    fifo = str(tmp_path / "model-00001-of-00002.safetensors")
    os.mkfifo(fifo)
    with pytest.raises(NotRegular, match="safetensors: a FIFO"):
        ByteSource(fifo).read(0, 8)
    with pytest.raises(NotRegular, match="safetensors: a FIFO"):
        read_bytes(fifo)
    close_all()


# -- declared sizes checked before anything is read ---------------------------------------------


def test_maxtext_step_leaf_declared_8_gib_is_refused_before_it_is_read(tmp_path, capsys):
    """A MaxText `step` leaf whose `.zarray` declares 2^31 int32 (8 GiB, all fill value: no chunk
    files needed) was allocated before it was checked (MemoryError traceback): now one line
    naming the leaf's shape, and nothing near its size allocated."""
    folder = _copy_case(tmp_path, "maxtext_llama3")
    zarray = os.path.join(folder, "4", "items", "step", ".zarray")
    with open(zarray) as f:
        spec = json.load(f)
    spec.update(shape=[1 << 31], chunks=[1 << 31], fill_value=0)
    os.remove(zarray)
    with open(zarray, "w") as f:
        json.dump(spec, f)
    config = os.path.join(REAL, "torchtitan_llama3", "config.json")
    capsys.readouterr()
    tracemalloc.start()
    try:
        code = main(["inspect", folder, "--config", config])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    # (refused when the item is opened, `containers.orbax.declared`: 8 GiB declared in an item of a few KB)
    assert ("leaf 'step'" in err and f"{4 << 31} bytes declared" in err) or (
        "step should hold one number" in err and str(1 << 31) in err), err
    assert peak < 256 << 20, peak


@pytest.mark.parametrize("shape", [(1 << 33,), (2, 3)])
def test_a_step_of_many_elements_is_refused_before_it_is_read(shape):
    from hybridckpt.io.byte_source import ByteSource, count_reads
    from hybridckpt.lazy import StoredTensor, scalar_value

    t = StoredTensor(ByteSource("/nonexistent/step"), 0, shape, np.dtype(np.float32))
    with count_reads() as reads, pytest.raises(FormatError) as e:
        scalar_value(t, "opt.pt: state.0", "step")
    assert str(e.value) == (
        f"opt.pt: state.0: step should hold one number, but it is declared float32 {list(shape)} "
        f"({int(np.prod(shape))} elements); not read"
    )
    assert sum(reads.values()) == 0
    assert scalar_value(np.array([7.0]), "w") == 7.0 and scalar_value(3, "w") == 3.0


def _dcp_declaring(tmp_path, shape) -> str:
    """torch's own DCP save of two small tensors, its `.metadata` edited (pickled by torch's
    classes) so that `model.w` and its one chunk declare `shape`."""
    import pickle

    import torch.distributed.checkpoint as dcp

    src = str(tmp_path / "src")
    sd = {"model.w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "model.b": torch.ones(8)}
    dcp.save(sd, checkpoint_id=src, no_dist=True)
    path = os.path.join(src, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)
    e = md.state_dict_metadata["model.w"]
    c = e.chunks[0]
    e.size = torch.Size(shape)
    e.chunks[0] = type(c)(offsets=c.offsets, sizes=torch.Size(shape))
    with open(path, "wb") as f:
        pickle.dump(md, f)
    return src


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("args", [["inspect"], ["import", "--plan"], ["import"]])
def test_dcp_metadata_declaring_4_tib_is_refused_before_planning(tmp_path, capsys, args):
    """A 1 KB `.metadata` declaring a 2^20 x 2^20 float32 tensor (4 TiB) in a 3 KB data file: one
    line naming the file, the tensor, the bytes declared and present; a few KB read, nothing
    written (an import --plan ran past 90 s on one, an import wrote until the disk was full)."""
    from hybridckpt.io.byte_source import count_reads

    src = _dcp_declaring(tmp_path, (1 << 20, 1 << 20))
    dst = str(tmp_path / "dst")
    cmd = [args[0], src, *([dst] if args[0] == "import" else []), *args[1:]]
    capsys.readouterr()
    with count_reads() as reads:
        code = main(cmd)
    close_all()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    assert "__0_0.distcp" in err and "'model.w' (float32 [1048576, 1048576])" in err, err
    assert f"{4 * (1 << 40)} bytes" in err and f"file of {os.path.getsize(os.path.join(src, '__0_0.distcp'))} bytes" in err
    assert sum(reads.values()) < 64 << 10
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_declared_bytes_within_the_file_still_read(tmp_path):
    from hybridckpt.formats.registry import open_source

    src = _dcp_declaring(tmp_path, (8, 8))  # rewritten by pickle, unchanged in meaning
    t = open_source(src).tensors["model.w"]
    assert np.array_equal(t.materialize(), np.arange(64, dtype=np.float32).reshape(8, 8))
    close_all()


# -- slow, if linear: counts capped where real files stay far under them ------------------------


def _safetensors_of(path: str, n: int) -> None:
    import struct

    hdr = {f"model.layers.{i}.w": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    head = json.dumps(hdr).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"\0" * (4 * n))


def test_safetensors_header_of_too_many_tensors_is_refused_before_parsing(tmp_path, monkeypatch):
    """A header past `MAX_TENSORS` entries is refused by a count in C, before one JSON value is
    built (a 96 MB header of 1.4M tensors took 32-94 s to inspect and 300+ s to plan)."""
    from hybridckpt.containers import safetensors_file as sf

    monkeypatch.setattr(sf, "MAX_TENSORS", 100)
    parsed = []
    monkeypatch.setattr(sf.json, "loads", lambda *a, **k: parsed.append(1))
    path = str(tmp_path / "model.safetensors")
    _safetensors_of(path, 101)
    with pytest.raises(FormatError, match=r"model\.safetensors: header of \d+ bytes holds about 101 tensors, more than the 100"):
        sf.read_header(path)
    assert parsed == []
    close_all()


def test_safetensors_header_at_the_cap_reads_every_tensor(tmp_path, monkeypatch):
    from hybridckpt.containers import safetensors_file as sf

    monkeypatch.setattr(sf, "MAX_TENSORS", 100)
    path = str(tmp_path / "model.safetensors")
    _safetensors_of(path, 100)
    st = sf.read_header(path)
    assert len(st.tensors) == 100 and st.tensors["model.layers.99.w"].offset == 8 + (os.path.getsize(path) - 8 - 400) + 396
    close_all()


def test_safetensors_duplicate_names_still_refused():
    from hybridckpt.containers import safetensors_file as sf

    with pytest.raises(sf._DuplicateKey):
        sf._no_duplicates([("a", 1), ("b", 2), ("a", 3)])
    assert sf._no_duplicates([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}
    with pytest.raises(TypeError):
        sf._ints([1, True])
    assert sf._ints([0, 7]) == (0, 7)


def test_the_budget_walks_only_what_the_memo_fetches(monkeypatch):
    """A pickle of 100k distinct records sharing one small object (as a DCP `.metadata` shares a
    few hundred): the budget counts what the fetches add by walking the fetched object alone,
    not the 100k records (it was a second pass over every object: +50% time, +1.2 GB at 10^6
    chunks). A fetch of the big list still counts it whole."""
    import pickle

    from hybridckpt.containers.pickle import budget, machine

    walked = []
    own = budget._own
    monkeypatch.setattr(budget, "_own", lambda obj: walked.append(1) or own(obj))
    props = {"dtype": "float32", "layout": [1, 2]}
    records = [{"offsets": (i, 0), "sizes": (1, 4), "properties": props} for i in range(100_000)]
    data = pickle.dumps(records, protocol=4)
    out = machine.safe_loads(data, what="md")
    assert out == records and len(walked) <= 3  # the fetched dict and its list
    walked.clear()
    data = pickle.dumps([records, records], protocol=4)
    out = machine.safe_loads(data, what="md")
    assert out[1] is out[0] and len(walked) > 100_000  # the fetched list: every record once
