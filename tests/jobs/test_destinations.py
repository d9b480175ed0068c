"""Destinations (issue 37 item 1, issue 38 "Destinations"): `--overwrite` replaces only what
hybridckpt wrote (our store, an export carrying `.hybridckpt-export`), never the working directory,
a folder above it, the home folder or `/`, never a folder a source file links into; an empty path
is an error everywhere. Each refusal is one line, exit 2, and the user's files are left as they
were, through the CLI and through the library API alike.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from attacks.hostile import tree_digest

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.io.byte_source import close_all
from hybridckpt.store import CheckpointStore
from hybridckpt.store.layout import HF_FILES, OPT_STATE, PARAMS, TRAINER_STATE
from hybridckpt.store.save import save_checkpoint
from hybridckpt.writers import ownership
from hybridckpt.writers.destination import Destination

TARGETS = ["hf", "dcp", "torchtitan", "megatron", "maxtext", "paddleformers-unified", "paddlenlp-unified"]


def cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(result, *must: str) -> None:
    code, _, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)


def user_folder(path, n: int = 3) -> dict:
    """A folder of the user's own files; returns its digest."""
    os.makedirs(path, exist_ok=True)
    for i in range(n):
        with open(os.path.join(path, f"{'abc'[i % 3]}{i // 3 or ''}.txt"), "w") as f:
            f.write(f"the user's file {i}\n")
    return tree_digest(str(path))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("store") / "ck")
    hybridckpt.import_checkpoint(sample_path(), out)
    return out


# -- empty paths ------------------------------------------------------------------------------------


def test_an_empty_path_is_an_error_everywhere(store, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    before = user_folder(work)
    monkeypatch.chdir(work)
    for args in (["inspect", ""], ["import", "", "x"], ["export", "", "x"], ["verify", ""], ["verify", "", store],
                 ["logits", "", "--tokens", "1"], ["import", sample_path(), "", "--overwrite"],
                 ["export", sample_path(), "", "--overwrite"], ["export", store, "", "--overwrite", "--to", "dcp"]):
        refused(cli(capsys, *args), "an empty path was given as")
    for call in (lambda: hybridckpt.import_checkpoint("", "x"),
                 lambda: hybridckpt.import_checkpoint(sample_path(), "", overwrite=True),
                 lambda: hybridckpt.export_checkpoint("", "x"),
                 lambda: hybridckpt.export_checkpoint(store, "", overwrite=True),
                 lambda: save_checkpoint("", 1, {"w": jnp.ones(4)}, overwrite=True),
                 lambda: CheckpointStore("")):
        with pytest.raises(CheckpointError, match="an empty path was given as"):
            call()
    assert tree_digest(str(work)) == before


# -- places a user lives in -------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["import", "export"])
def test_the_working_directory_and_the_folders_above_it_are_never_replaced(tmp_path, monkeypatch, capsys, command):
    top = tmp_path / "top"
    work = top / "work"
    before = user_folder(work)
    user_folder(top, 1)
    top_before = tree_digest(str(top))
    monkeypatch.chdir(work)
    for dst, what in ((".", "is the working directory"), (str(work), "is the working directory"),
                      ("..", "holds the working directory"), (str(top), "holds the working directory")):
        refused(cli(capsys, command, sample_path(), dst, "--overwrite"), what)
        refused(cli(capsys, command, sample_path(), dst), what)
    assert tree_digest(str(work)) == before and tree_digest(str(top)) == top_before
    assert sorted(os.listdir(tmp_path)) == ["top"]


def test_home_root_and_an_unexpanded_tilde_are_never_destinations(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    before = user_folder(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    refused(cli(capsys, "export", sample_path(), home, "--overwrite"), "is the home folder")
    refused(cli(capsys, "import", sample_path(), "~", "--overwrite"), "starts with '~'")
    refused(cli(capsys, "export", sample_path(), "~/out"), "starts with '~'")
    assert tree_digest(str(home)) == before and sorted(os.listdir(tmp_path)) == ["home"]
    with pytest.raises(CheckpointError, match="is the root folder"):  # checked before anything is written
        Destination("/", overwrite=True).preflight()
    with pytest.raises(CheckpointError, match="is the home folder"):
        hybridckpt.export_checkpoint(sample_path(), str(home), overwrite=True)


# -- what --overwrite replaces --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["import", "export"])
def test_a_folder_of_other_files_is_never_replaced(store, tmp_path, capsys, command):
    dst = tmp_path / "data"
    before = user_folder(dst)
    for flags in (["--overwrite"], []):
        code, _, err = cli(capsys, command, sample_path(), dst, *flags)
        refused((code, "", err), f"{dst}: holds 3 files not written by hybridckpt: a.txt, b.txt, c.txt")
        assert "pass --overwrite" not in err  # it would not help
    call = hybridckpt.import_checkpoint if command == "import" else hybridckpt.export_checkpoint
    with pytest.raises(CheckpointError, match="holds 3 files not written by hybridckpt"):
        call(sample_path(), str(dst), overwrite=True)
    with pytest.raises(CheckpointError, match="holds 3 files not written by hybridckpt"):
        save_checkpoint(str(dst), 1, {"w": jnp.ones(4)}, overwrite=True)
    assert tree_digest(str(dst)) == before
    assert sorted(os.listdir(tmp_path)) == ["data"]  # nothing beside it (no .lock, no .tmp-*)


def test_a_folder_of_many_files_is_named_in_one_line(tmp_path, capsys):
    dst = tmp_path / "data"
    user_folder(dst, 9)
    (dst / "line\nbreak").write_text("x")  # a name that would break the line
    before = tree_digest(str(dst))
    refused(cli(capsys, "export", sample_path(), dst, "--overwrite"),
            "holds 10 files not written by hybridckpt: a.txt, a1.txt, a2.txt, b.txt, b1.txt, ...")
    assert tree_digest(str(dst)) == before


@pytest.mark.parametrize("target", TARGETS)
def test_every_export_is_marked_and_replaced_only_while_it_holds_only_its_files(store, tmp_path, capsys, target):
    out = tmp_path / "out"
    assert cli(capsys, "export", store, out, "--to", target)[0] == 0
    marker = json.loads((out / ownership.MARKER).read_text())
    listed = sorted(os.path.relpath(os.path.join(r, f), out) for r, _, fs in os.walk(out) for f in fs)
    assert marker["written_by"] == "hybridckpt" and sorted(marker["files"]) == [f for f in listed if f != ownership.MARKER]
    code, _, err = cli(capsys, "export", store, out, "--to", target, "--overwrite")  # ours: replaced
    assert code == 0, err
    deep = os.path.join(out, sorted(marker["files"])[-1])
    notes = os.path.join(os.path.dirname(deep), "notes.txt")
    with open(notes, "w") as f:
        f.write("mine")
    refused(cli(capsys, "export", store, out, "--to", target, "--overwrite"),
            f"holds 1 file not written by hybridckpt: {os.path.relpath(notes, out)}")
    with pytest.raises(CheckpointError, match="not written by hybridckpt"):
        hybridckpt.export_checkpoint(store, str(out), to=target, overwrite=True)
    assert open(notes).read() == "mine" and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_forged_or_damaged_marker_does_not_make_a_folder_ours(tmp_path, capsys):
    for i, body in enumerate(["{not json", json.dumps({"written_by": "someone", "files": ["a.txt"]}),
                              json.dumps({"written_by": "hybridckpt", "files": "a.txt"}), "[" * 100_000]):
        dst = tmp_path / f"d{i}"
        user_folder(dst, 1)
        (dst / ownership.MARKER).write_text(body)
        before = tree_digest(str(dst))
        refused(cli(capsys, "export", sample_path(), dst, "--overwrite"), "not written by hybridckpt", "a.txt")
        assert tree_digest(str(dst)) == before


def test_our_store_is_recognised_by_what_it_writes(store, tmp_path, capsys):
    # an import's store, replaced by an import (library and CLI) and by the store's save
    ck = tmp_path / "ck"
    shutil.copytree(store, ck)
    assert sorted(os.listdir(ck / "12")) == sorted(["_CHECKPOINT_METADATA", "commit_success.txt", HF_FILES, PARAMS,
                                                    OPT_STATE, TRAINER_STATE])
    assert set(os.listdir(ck / "12")) <= ownership.STEP_ENTRIES
    assert cli(capsys, "import", sample_path(), ck, "--overwrite", "--params-only")[0] == 0
    assert not (ck / "12" / OPT_STATE).exists()  # replaced, not merged
    save_checkpoint(str(ck), 3, {"w": jnp.arange(4.0)}, overwrite=True)
    assert sorted(os.listdir(ck)) == ["3"]
    # a training loop's store (several steps), replaced by an import
    run = tmp_path / "run"
    with CheckpointStore(run, max_to_keep=2) as s:
        for step in (1, 2, 3):
            s.save(step, {"w": jnp.full((8,), step, jnp.float32)}, trainer_state={"loss": 1.0 / step})
    assert sorted(os.listdir(run)) == ["2", "3"]
    assert cli(capsys, "import", sample_path(), run, "--overwrite")[0] == 0
    assert sorted(os.listdir(run)) == ["12"]
    # one file of the user's in a step folder, or beside the steps: the store is kept
    for where in (run / "12" / "notes.txt", run / "notes.txt"):
        where.write_text("mine")
        refused(cli(capsys, "import", sample_path(), run, "--overwrite"),
                f"holds 1 file not written by hybridckpt: {os.path.relpath(where, run)}")
        assert where.read_text() == "mine"
        where.unlink()
    # numbered folders of something else are not a store
    other = tmp_path / "other"
    (other / "1").mkdir(parents=True)
    (other / "1" / "data.bin").write_bytes(b"\0" * 8)
    refused(cli(capsys, "import", sample_path(), other, "--overwrite"), "holds 1 file not written by hybridckpt: 1/data.bin")


def test_a_folder_a_source_links_into_is_never_replaced(store, tmp_path, capsys):
    """The Hugging Face cache's layout: `snapshots/<rev>/<file>` are symlinks into `blobs/`.
    Replacing `blobs` (even a folder hybridckpt wrote) would leave the source dangling."""
    real = tmp_path / "real"
    assert cli(capsys, "export", store, real)[0] == 0  # ours: --overwrite could replace it
    blobs = tmp_path / "cache" / "blobs"
    snap = tmp_path / "cache" / "snapshots" / "abc123"
    shutil.copytree(real, blobs)
    (blobs / ownership.MARKER).unlink()
    for folder, link_dir in ((real, tmp_path / "links"), (blobs, snap)):
        link_dir.mkdir(parents=True)
        for name in os.listdir(folder):
            if name != ownership.MARKER:
                os.symlink(os.path.relpath(folder / name, link_dir), link_dir / name)
    for folder, link_dir in ((real, tmp_path / "links"), (blobs, snap)):
        before = tree_digest(str(folder))
        for target in ("hf", "dcp"):
            refused(cli(capsys, "export", link_dir, folder, "--overwrite", "--to", target),
                    f"{folder}: the source {link_dir} links into it")
        with pytest.raises(CheckpointError, match="links into it"):
            hybridckpt.export_checkpoint(str(link_dir), str(folder), overwrite=True)
        assert tree_digest(str(folder)) == before
        loaded = hybridckpt.open_checkpoint(str(link_dir))  # the source still reads, every link resolves
        first = sorted(loaded.named.params)[0]
        assert np.asarray(loaded.named.params[first].read()).size > 0
    assert sorted(os.listdir(tmp_path)) == ["cache", "links", "real"]


def test_the_marker_is_harmless_to_the_tools_that_load_exports(store, tmp_path, capsys):
    """Transformers loads an HF export, torch DCP reads a DCP export's metadata and Orbax (MaxText's
    loader) lists a MaxText export's step, each with `.hybridckpt-export` beside the files."""
    import orbax.checkpoint as ocp
    import torch
    import transformers
    from torch.distributed.checkpoint import FileSystemReader

    outs = {t: tmp_path / t for t in ("hf", "dcp", "maxtext")}
    for target, out in outs.items():
        assert cli(capsys, "export", store, out, "--to", target)[0] == 0
        assert (out / ownership.MARKER).is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(outs["hf"], torch_dtype=torch.float32)
    want = hybridckpt.open_checkpoint(store).named.params["model.norm.weight"].read()
    np.testing.assert_array_equal(model.state_dict()["model.norm.weight"].numpy(), np.asarray(want, np.float32))
    meta = FileSystemReader(str(outs["dcp"])).read_metadata()
    assert "model.model.norm.weight" in meta.state_dict_metadata
    with ocp.CheckpointManager(outs["maxtext"]) as manager:
        assert manager.all_steps() == [12]
