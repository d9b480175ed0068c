"""Issue 37, "smaller ones": each found by a new user through the CLI or the Python API, each a
one-line error (exit 2) or the documented behaviour, pinned by a test that failed before the
fix. Items a..j of the issue, in order."""

from __future__ import annotations

import os

import numpy as np

import hybridckpt
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import close_all


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    close_all()
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str, *must: str) -> str:
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("hybridckpt: error:"), err
    for m in must:
        assert m in err, (m, err)
    return err


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- a: logits --out ----------------------------------------------------------------------------------


def test_logits_out_is_written_at_exactly_the_path_given_and_a_missing_folder_is_one_line(tmp_path, capsys,
                                                                                           monkeypatch):
    src = sample_path()
    monkeypatch.chdir(tmp_path)  # the relative --out paths are the user's, from their folder
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2,3", "--out", "missing/x.npy")
    one_line(code, err, "--out missing/x.npy", "missing does not exist")
    assert "Traceback" not in err and listing(tmp_path) == []
    (tmp_path / "afile").write_text("mine")
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2,3", "--out", "afile/x.npy")
    one_line(code, err, "afile/x.npy")
    assert (tmp_path / "afile").read_text() == "mine"

    code, out, err = cli(capsys, "logits", src, "--tokens", "1,2,3", "--out", "out.txt")
    assert code == 0, err
    assert "written to out.txt" in out and listing(tmp_path) == ["afile", "out.txt"]
    expected = hybridckpt.logits(src, [1, 2, 3])
    np.testing.assert_array_equal(np.load(tmp_path / "out.txt"), expected)


def test_logits_out_that_cannot_be_written_is_one_line_and_leaves_the_old_file(tmp_path, capsys, monkeypatch):
    src = sample_path()
    old = tmp_path / "x.npy"
    old.write_bytes(b"the user's own file")
    real_save = np.save

    def disk_full(f, arr, **kw):  # half of the array written, then the disk is full
        real_save(f, arr, **kw)
        f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "save", disk_full)
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", old)
    one_line(code, err, f"--out {old}", "No space left on device")
    assert old.read_bytes() == b"the user's own file" and listing(tmp_path) == ["x.npy"]

    real_open = os.open

    def read_only(path, flags, *a, **kw):  # a read-only folder (even for root)
        if os.path.dirname(os.fspath(path)) == str(tmp_path) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(np, "save", real_save)
    monkeypatch.setattr(os, "open", read_only)
    code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", tmp_path / "y.npy")
    one_line(code, err, "y.npy", "Permission denied")
    assert listing(tmp_path) == ["x.npy"]
    for bad, why in (("", "expected the path"), (tmp_path, "is a folder")):
        code, _, err = cli(capsys, "logits", src, "--tokens", "1,2", "--out", bad)
        one_line(code, err, why)


# -- b: restore of what is not one of ours --------------------------------------------------------------


def test_restore_of_an_absent_folder_creates_nothing_and_another_format_is_named_with_its_import(tmp_path, capsys):
    import pytest
    import torch
    import torch.distributed.checkpoint as dcp

    from hybridckpt.errors import CheckpointError

    absent = tmp_path / "nothere"
    with pytest.raises(CheckpointError, match="no such folder") as e:
        hybridckpt.restore(str(absent))
    assert "\n" not in str(e.value) and listing(tmp_path) == []

    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp_path / "dcp"))
    for src, fmt in ((sample_path(), "hf"), (str(tmp_path / "dcp"), "dcp")):
        before = listing(src)
        with pytest.raises(CheckpointError) as e:
            hybridckpt.restore(src)
        assert str(e.value).startswith(f"{src} is a {fmt} checkpoint, not a hybridckpt store; import it first"), e.value
        assert listing(src) == before
        code, _, err = cli(capsys, "verify", src)  # the command's words in the command line
        one_line(code, err, f"{src} is a {fmt} checkpoint, not a hybridckpt store",
                 f"import it first: hybridckpt import {src} DST")


# -- c: make_mesh takes the first N devices, as the CLI and restore do ------------------------------------


def test_make_mesh_takes_the_first_devices_its_sizes_multiply_to_like_every_job():
    import jax
    import pytest
    from meshes import fit

    from hybridckpt.errors import MeshError
    from hybridckpt.mesh import MeshShape

    shape = MeshShape.parse(fit("fsdp=2,tp=2"))  # 4 of the 8 devices
    m = hybridckpt.make_mesh(**shape.as_dict())
    assert list(m.devices.flat) == jax.devices()[: shape.size] and dict(m.shape) == shape.as_dict()
    from hybridckpt.mesh import as_mesh

    for given in (str(shape), shape, m):  # the one coercion every job uses
        assert as_mesh(given).devices.tolist() == m.devices.tolist()
    with pytest.raises(MeshError, match="expected a jax.sharding.Mesh, a MeshShape or text"):
        as_mesh(4)
    with pytest.raises(MeshError, match="sizes must be positive"):
        hybridckpt.make_mesh(tp=0)


# -- d: a plain torch.save(state_dict) file is a source ----------------------------------------------------


def _tiny_llama(tmp_path):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = transformers.LlamaForCausalLM(cfg)
    cfg.save_pretrained(tmp_path / "cfg")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "cfg" / "config.json"


def test_a_torch_save_state_dict_by_any_name_is_read_and_imports_as_the_family_with_config(tmp_path, capsys):
    import json

    import torch

    sd, config = _tiny_llama(tmp_path)
    (tmp_path / "folder").mkdir()
    files = {
        "model.pt": (sd, {}),
        "weights.pth": ({"model": sd, "epoch": 3}, {}),  # a training script's wrapper
        "anything.bin": ({"state_dict": sd}, {}),
        "legacy.ckpt": (sd, {"_use_new_zipfile_serialization": False}),
        "folder/w": (sd, {}),  # a folder holding one such file
    }
    for name, (obj, kw) in files.items():
        torch.save(obj, tmp_path / name, **kw)
    for name in files:
        src = tmp_path / name.split("/")[0]
        code, out, err = cli(capsys, "inspect", src, "--json")
        assert code == 0, err
        info = json.loads(out)
        assert info["format"] == "torch" and info["needs_config"], info
        assert {t["name"]: tuple(t["shape"]) for t in info["tensors"]} == {k: tuple(v.shape) for k, v in sd.items()}

    code, out, err = cli(capsys, "import", tmp_path / "weights.pth", tmp_path / "ck", "--config", config, "--quiet")
    assert code == 0, err
    assert "the state dict under 'model'; its other entries are not read: 'epoch'" in out
    code, _, err = cli(capsys, "export", tmp_path / "ck", tmp_path / "out", "--quiet")
    assert code == 0, err
    from safetensors.numpy import load_file

    back = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        np.testing.assert_array_equal(back[k], v.numpy(), err_msg=k)


def test_a_torch_file_under_format_hf_or_holding_no_state_dict_is_one_line(tmp_path, capsys):
    import torch

    sd, _ = _tiny_llama(tmp_path)
    torch.save(sd, tmp_path / "model.pt")
    code, _, err = cli(capsys, "inspect", tmp_path / "model.pt", "--format", "hf")
    one_line(code, err, f"{tmp_path / 'model.pt'} is not a safetensors file: it is a torch.save file")
    (tmp_path / "notes.txt").write_bytes(b"\xff" * 64)
    code, _, err = cli(capsys, "inspect", tmp_path / "notes.txt", "--format", "hf")
    one_line(code, err, "notes.txt is not a safetensors file: header length")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    code, _, err = cli(capsys, "inspect", tmp_path / "list.pt")
    one_line(code, err, "list.pt: expected a state dict (name -> tensor), found list")
    torch.save({"w": torch.zeros(2), "lr": 0.1}, tmp_path / "mixed.pt")
    code, _, err = cli(capsys, "inspect", tmp_path / "mixed.pt")
    one_line(code, err, "mixed.pt: entry 'lr': expected a tensor under a str name, found float")


# -- e: a training loop's CheckpointStore saves are checked on every read ---------------------------------


def _flip_a_bit(item_dir, array: str, index: tuple[int, ...]) -> None:
    """Flip the low bit of one element of a stored array, through TensorStore (the chunk is
    re-encoded: damage its zstd codec cannot see, as a bit flipped before compression would be)."""
    import tensorstore as ts

    from hybridckpt.containers.orbax.ts_spec import context, read_spec

    spec = {k: v for k, v in read_spec(str(item_dir), array, use_ocdbt=True).items()
            if k not in ("fill_missing_data_reads", "recheck_cached_data", "recheck_cached_metadata")}
    t = ts.open(spec, open=True, context=context(use_ocdbt=True)).result()
    v = np.asarray(t[index].read().result())
    t[index].write((v.view(np.uint32) ^ 1).view(v.dtype)).result()


def test_a_checkpoint_store_save_records_crc32s_and_a_flipped_byte_is_one_line_on_restore_and_verify(tmp_path, capsys):
    import jax
    import optax
    import pytest
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from meshes import fit

    from hybridckpt.errors import CheckpointError
    from hybridckpt.mesh import as_mesh
    from hybridckpt.store import CheckpointStore

    mesh = as_mesh(fit("fsdp=2,tp=2"))
    rng = np.random.default_rng(0)
    host = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}
    params = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("fsdp", "tp"))),
              "b": jax.device_put(host["b"], NamedSharding(mesh, P()))}
    tx = optax.adamw(1e-2)
    grads = jax.tree.map(lambda x: x * 0.5, params)
    updates, opt_state = tx.update(grads, tx.init(params), params)
    run = tmp_path / "run"
    with CheckpointStore(run) as store:
        store.save(7, params, opt_state, {"loss": 1.5})
    code, out, err = cli(capsys, "verify", run)
    assert code == 0 and "7/7 arrays match their import checksums" in out, (out, err)
    _, restored = hybridckpt.restore(str(run), "dp=1")
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), host["w"])

    _flip_a_bit(run / "7" / "params", "w", (33, 17))
    with pytest.raises(CheckpointError, match=r"params: array w: chunk .* has CRC-32") as e:
        hybridckpt.restore(str(run), "dp=1")
    assert "\n" not in str(e.value)
    code, out, err = cli(capsys, "verify", run)
    assert code == 1 and "BAD params.w" in out and "6/7 arrays match" in out, (out, err)


# -- f: the quick start's export --optimizer on a weights-only source --------------------------------------


def test_export_optimizer_of_a_weights_only_source_exports_the_weights_and_says_so(tmp_path, capsys):
    from safetensors.numpy import load_file

    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):  # the sample without its optimizer.safetensors
        (src / name).write_bytes(open(os.path.join(sample_path(), name), "rb").read())
    code, _, err = cli(capsys, "import", src, tmp_path / "ckpt", "--quiet")
    assert code == 0, err
    code, out, err = cli(capsys, "export", tmp_path / "ckpt", tmp_path / "hf-out", "--optimizer", "--quiet")
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert notes == [f"note: {tmp_path / 'ckpt'} holds no optimizer state (weights only): the weights are exported "
                     "without it"], out
    assert not any(n.startswith("optimizer") for n in listing(tmp_path / "hf-out"))
    back, want = load_file(tmp_path / "hf-out" / "model.safetensors"), load_file(src / "model.safetensors")
    assert sorted(back) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(back[k], want[k], err_msg=k)


# -- g: inspect of a MaxText checkpoint without --config lists its tensors ---------------------------------


def test_inspect_of_a_maxtext_checkpoint_without_config_lists_its_tensors(tmp_path, capsys):
    import json

    out = tmp_path / "mt"
    hybridckpt.export_checkpoint(sample_path(), str(out), to="maxtext", optimizer=True)
    code, text, err = cli(capsys, "inspect", out, "--json")
    assert code == 0, err
    bare = json.loads(text)
    code, text, err = cli(capsys, "inspect", out, "--json", "--config", os.path.join(sample_path(), "config.json"))
    assert code == 0, err
    with_config = json.loads(text)
    assert bare["format"] == "maxtext" and bare["needs_config"] and bare["config"] is None
    assert bare["tensors"] == with_config["tensors"] and len(bare["tensors"]) == 12  # the same arrays, as stored
    assert {"name": "decoder.layers.mlp.wi_0.kernel", "shape": [2, 32, 64], "dtype": "float32", "pieces": 1} in bare["tensors"]
    assert bare["optimizer"]["slots"] == ["exp_avg", "exp_avg_sq"] and bare["step"] == 12


# -- h: --config DIR takes DIR/config.json ------------------------------------------------------------------


def test_config_given_as_a_folder_takes_its_config_json_and_a_folder_without_one_is_one_line(tmp_path, capsys):
    import json

    import torch

    sd, config = _tiny_llama(tmp_path)
    torch.save(sd, tmp_path / "model.pt")
    (config.parent / "tokenizer_config.json").write_text("{}")
    code, out, err = cli(capsys, "inspect", tmp_path / "model.pt", "--json", "--config", config.parent)
    assert code == 0, err
    info = json.loads(out)
    assert info["config"]["family"] == "llama" and info["config"]["num_kv_heads"] == 1
    assert info["files"] == ["config.json", "tokenizer_config.json"]  # the folder's files travel, as beside a file
    (tmp_path / "empty").mkdir()
    code, _, err = cli(capsys, "inspect", tmp_path / "model.pt", "--config", tmp_path / "empty")
    one_line(code, err, f"--config {tmp_path / 'empty'}: a folder without config.json or params.json")


# -- i: a config of another family is named as such ----------------------------------------------------------


def test_a_qwen3_config_on_a_llama_checkpoint_names_the_family_mismatch(tmp_path, capsys):
    import torch
    import transformers

    sd, _ = _tiny_llama(tmp_path)
    torch.save(sd, tmp_path / "model.pt")
    for cls, fam, missing in ((transformers.Qwen3Config, "qwen3", "model.layers.0.self_attn.k_norm.weight"),
                              (transformers.Qwen2Config, "qwen2", "model.layers.0.self_attn.k_proj.bias")):
        cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8).save_pretrained(tmp_path / fam)
        code, _, err = cli(capsys, "import", tmp_path / "model.pt", tmp_path / f"ck-{fam}", "--config", tmp_path / fam)
        msg = one_line(code, err, f"the config is {fam}, but the checkpoint's tensors are those of a ",
                       "llama", f"({missing}", "missing); pass the checkpoint's own config")
        assert "expects" not in msg and not os.path.exists(tmp_path / f"ck-{fam}")
    # the checkpoint's own family still imports
    transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8).save_pretrained(tmp_path / "llama")
    code, _, err = cli(capsys, "import", tmp_path / "model.pt", tmp_path / "ck", "--config", tmp_path / "llama", "--quiet")
    assert code == 0, err


# -- j: inspect shows a DCP checkpoint's param groups ----------------------------------------------------------


def test_inspect_shows_the_param_groups_a_dcp_checkpoint_records(tmp_path, capsys):
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    for name, groups in (("alike", [{"params": weights}, {"params": biases}]),  # two groups, the same values
                         ("differ", [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]),
                         ("one", [{"params": weights + biases}])):
        opt = torch.optim.AdamW(groups, lr=1e-3)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / name))
        code, out, err = cli(capsys, "inspect", tmp_path / name, "--json")
        assert code == 0, err
        shown = json.loads(out)["optimizer"]["param_groups"]
        want = [{"lr": 1e-3, "weight_decay": g.get("weight_decay", 0.01), "params": len(g["params"])} for g in groups]
        assert [{k: g[k] for k in ("lr", "weight_decay", "params")} for g in shown] == want, (name, shown)
        assert all(g["betas"] == [0.9, 0.999] for g in shown)


def test_verify_of_one_checkpoint_refuses_the_flags_it_cannot_honour(tmp_path, capsys):
    """`verify A` alone re-reads A against its import's checksums: --config, --atol, --params-only
    and --no-verify-reads were accepted and ignored there; now each is one line, exit 2, and the
    plain `verify A` still passes."""
    ck = str(tmp_path / "ck")
    assert cli(capsys, "import", sample_path(), ck, "--quiet")[0] == 0
    for flags in (["--config", os.path.join(sample_path(), "config.json")], ["--atol", "1e-3"], ["--params-only"],
                  ["--no-verify-reads"]):
        code, _, err = cli(capsys, "verify", ck, *flags)
        assert code == 2 and f"{flags[0]}: only for comparing two checkpoints" in err, (flags, err)
        assert len(err.strip().splitlines()) == 1
    assert cli(capsys, "verify", ck)[0] == 0
