"""HF safetensors import/export against transformers' own models and forward pass."""

import json
import os

import jax
import meshes
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from meshes import device_count, fit, fit_mesh, size

from hybridckpt import jobs, models, naming, optim, plan
from hybridckpt.containers.safetensors_file import read_header
from hybridckpt.formats.registry import open_source
from hybridckpt.mesh import tree_shardings
from hybridckpt.plan import abstract_tree
from hybridckpt.store import CheckpointStore

TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4], [0, 11, 42, 17, 6, 5, 90, 3]], dtype=np.int32)


def _llama(tied: bool):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied, rope_theta=5000.0, max_position_embeddings=64,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> (folder, torch model) for transformers-written tiny checkpoints."""
    torch.manual_seed(0)
    out = {}
    for name, make, kwargs in [
        ("llama", lambda: _llama(False), {}),
        ("llama_tied", lambda: _llama(True), {}),
        ("llama_sharded", lambda: _llama(False), {"max_shard_size": "40KB"}),
        ("gpt2", _gpt2, {}),
    ]:
        m = make()
        d = tmp_path_factory.mktemp(name)
        m.save_pretrained(d, **kwargs)
        out[name] = (str(d), m)
    m = _llama(False).to(torch.bfloat16)
    d = tmp_path_factory.mktemp("llama_bf16")
    m.save_pretrained(d)
    out["llama_bf16"] = (str(d), m)
    return out


def _torch_logits(m):
    with torch.no_grad():
        return m.float()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama_sharded", "gpt2", "llama_bf16"])
@pytest.mark.parametrize("mesh", meshes.cases(["dp=1", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"]))
def test_logits_equal_transformers(hf_dirs, name, mesh):
    folder, m = hf_dirs[name]
    if name == "llama_sharded":
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    got = jobs.logits(folder, TOKENS, mesh=mesh)
    want = _torch_logits(m)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_hf_import_restore_export_is_bitwise(hf_dirs, tmp_path):
    folder, _ = hf_dirs["llama_sharded"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    s = jobs.import_checkpoint(folder, ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    assert s.tensors == 9 + 3  # 9 stacked layer leaves + embed, final norm, lm_head
    # restore onto a different mesh, check the sharding really differs, export, compare
    cfg = jobs.open_checkpoint(folder).config
    mesh = fit_mesh("dp=2,tp=4")
    shapes = models.param_shapes(cfg)
    shard = tree_shardings(shapes, models.logical_axes(cfg), mesh)
    with CheckpointStore(ckpt) as store:
        r = store.restore(target_params=abstract_tree(shapes, shard))
    assert r.params["layers"]["q"]["kernel"].sharding.spec != ("pp", "fsdp", "tp")
    jobs.export_checkpoint(ckpt, out, max_shard_bytes=30_000)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    a = open_source(folder).tensors
    b = open_source(out).tensors
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k].materialize(), b[k].materialize())
    # and transformers loads our export
    m2 = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(m2), _torch_logits(hf_dirs["llama_sharded"][1]), atol=0, rtol=0)


def test_bf16_weights_stay_bf16_and_export_bitwise(hf_dirs, tmp_path):
    folder, _ = hf_dirs["llama_bf16"]
    src = open_source(folder)
    assert all(t.dtype == np.dtype(ml_dtypes.bfloat16) for t in src.tensors.values())
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    jobs.import_checkpoint(folder, ckpt, mesh=fit("tp=2,pp=2,fsdp=2"))
    jobs.export_checkpoint(ckpt, out)
    b = read_header(os.path.join(out, "model.safetensors")).tensors
    for k, t in src.tensors.items():
        assert b[k].dtype == t.dtype
        np.testing.assert_array_equal(b[k].materialize().view(np.uint16), t.materialize().view(np.uint16))


def test_optimizer_roundtrip_through_unified_layout(tmp_path):
    """Moments written as optimizer.safetensors import into optax mu/nu sharded like the params."""
    from hybridckpt.demo import sample_path

    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh=fit("fsdp=2,tp=2,pp=2"))
    src = jobs.open_checkpoint(sample_path())
    cfg = src.config
    mesh = fit_mesh("tp=4,pp=2")
    p = plan.for_model(cfg, mesh, optimizer=optim.get("adamw"))
    with CheckpointStore(ckpt) as store:
        r = store.restore(target_params=p.param_targets(), target_opt_state=p.opt_targets())
    adam = r.opt_state[0]
    assert int(adam.count) == src.named.step == 12
    mu_hf = naming.tree_to_hf(jax.tree.map(np.asarray, adam.mu), cfg)
    for k, t in src.named.slots["exp_avg"].items():
        np.testing.assert_array_equal(mu_hf[k].materialize(), t.materialize())
    assert adam.mu["layers"]["q"]["kernel"].sharding == r.params["layers"]["q"]["kernel"].sharding


# -- bad input -------------------------------------------------------------------------------------


def _cli(capsys, *argv):
    from hybridckpt.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy(folder, dst):
    import shutil

    shutil.copytree(folder, dst)
    return str(dst)


def test_bad_inputs_exit_2_with_one_line_and_write_nothing(hf_dirs, tmp_path, capsys):
    folder, _ = hf_dirs["llama"]
    cases = []
    no_cfg = _copy(folder, tmp_path / "no_cfg")
    os.remove(os.path.join(no_cfg, "config.json"))
    cases.append((no_cfg, [], "config.json: missing"))
    unknown = _copy(folder, tmp_path / "unknown")
    cfg = json.load(open(os.path.join(unknown, "config.json")))
    cfg["architectures"], cfg["model_type"] = ["FalconForCausalLM"], "falcon"
    json.dump(cfg, open(os.path.join(unknown, "config.json"), "w"))
    # an architecture no family implements is read model-agnostic, not refused
    code, out, err = _cli(capsys, "import", unknown, str(tmp_path / "generic"), "--quiet")
    assert code == 0 and "FalconForCausalLM, which no model family implements: tensors imported under the source's own names" in out, err
    code, out, err = _cli(capsys, "logits", unknown, "--tokens", "1")
    assert code == 2 and "FalconForCausalLM is not supported by any model family" in err
    wrong = _copy(folder, tmp_path / "wrong_shape")
    cfg = json.load(open(os.path.join(wrong, "config.json")))
    cfg["intermediate_size"] = 48
    json.dump(cfg, open(os.path.join(wrong, "config.json"), "w"))
    cases.append((wrong, [], "layers.down.kernel has shape (2, 64, 32), the model expects (2, 48, 32)"))
    extra = tmp_path / "extra"
    extra.mkdir()
    tensors = {k: v.materialize() for k, v in open_source(folder).tensors.items()}
    tensors["model.layers.0.mlp.extra_proj.weight"] = np.zeros((2, 2), np.float32)
    del tensors["model.norm.weight"]
    from hybridckpt.containers.safetensors_file import write

    write(str(extra / "model.safetensors"), tensors)
    _copy_cfg = json.load(open(os.path.join(folder, "config.json")))
    json.dump(_copy_cfg, open(extra / "config.json", "w"))
    cases.append((str(extra), [], "'model.layers.0.mlp.extra_proj.weight'"))
    if device_count() >= 4:  # pp=8 (pp=4 on 4 devices) cannot divide the 2 layers
        pp = fit("pp=8")
        cases.append((folder, ["--mesh", pp, "--strict-sharding"], f"dim 0 (layers) has size 2, which mesh axes ('pp',) of total size {size(pp)} cannot divide"))
    elif device_count() == 2:  # every dim of this model is even: a copy with 95 vocab rows
        odd = _copy(folder, tmp_path / "odd_vocab")
        tensors = {k: v.materialize() for k, v in open_source(odd).tensors.items()}
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[k] = np.ascontiguousarray(tensors[k][:95])
        write(os.path.join(odd, "model.safetensors"), tensors)
        cfg = json.load(open(os.path.join(odd, "config.json")))
        cfg["vocab_size"] = 95
        json.dump(cfg, open(os.path.join(odd, "config.json"), "w"))
        cases.append((odd, ["--mesh", "tp=2", "--strict-sharding"], "has size 95, which mesh axes ('tp',) of total size 2 cannot divide"))
    # (on one device every mesh axis has size 1, which divides everything: no such case)
    for src, extra_args, message in cases:
        dst = tmp_path / ("dst_" + os.path.basename(src) + str(len(extra_args)))
        code, out, err = _cli(capsys, "import", src, str(dst), *extra_args, "--quiet")
        assert code == 2, (src, out, err)
        assert err.startswith("hybridckpt: error:") and err.count("\n") == 1, err
        assert message in err, err
        assert "Traceback" not in err
        assert not dst.exists()
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".dst_")]


def test_missing_rule_key_is_named_and_debug_shows_traceback(hf_dirs, tmp_path, capsys):
    code, _, err = _cli(capsys, "--debug", "inspect", str(tmp_path / "nothing-here"))
    assert code == 2 and "nothing-here: no such file or directory" in err and "Traceback" in err


def test_cli_inspect_import_export_verify(hf_dirs, tmp_path, capsys):
    folder, _ = hf_dirs["gpt2"]
    code, out, _ = _cli(capsys, "inspect", folder, "--json")
    info = json.loads(out)
    assert code == 0 and info["format"] == "hf" and info["config"]["family"] == "gpt2"
    ckpt, out_dir = str(tmp_path / "ckpt"), str(tmp_path / "out")
    assert _cli(capsys, "import", folder, ckpt, "--mesh", fit("fsdp=2,pp=2"), "--io-threads", "2", "--quiet")[0] == 0
    code, out, _ = _cli(capsys, "inspect", ckpt)
    assert code == 0 and "layers.qkv.kernel" in out
    assert _cli(capsys, "export", ckpt, out_dir, "--quiet")[0] == 0
    code, out, _ = _cli(capsys, "verify", folder, out_dir)
    assert code == 0 and "items match" in out
    # a changed tensor makes verify fail with exit 1
    t = {k: v.materialize() for k, v in open_source(out_dir).tensors.items()}
    t["transformer.h.1.mlp.c_fc.bias"] = t["transformer.h.1.mlp.c_fc.bias"] + 1e-3
    from hybridckpt.containers.safetensors_file import write

    write(os.path.join(out_dir, "model.safetensors"), t)
    code, out, _ = _cli(capsys, "verify", folder, out_dir)
    assert code == 1 and "BAD transformer.h.1.mlp.c_fc.bias" in out
    code, out, _ = _cli(capsys, "logits", folder, "--tokens", "1,2,3", "--out", str(tmp_path / "l.npy"))
    assert code == 0 and np.load(tmp_path / "l.npy").shape == (1, 3, 96)
