"""Each tensor keeps its stored dtype through import, our store, restore onto another mesh and
export, unless `--dtype` says otherwise (issue 37, item 4; `hybridckpt.lazy.dtypes`).

Sources are written by the real tools in this session: tiny GPT-OSS and Llama models by
transformers' `save_pretrained`, given a state dict in bf16 whose RMSNorm weights are fp32 (the
GPT-OSS release's layout), and a plain named tree (bf16, fp32, fp16 and int64 tensors, no model)
by `torch.distributed.checkpoint.save`. Exports are read back by safetensors' own loader (torch
tensors) and compared with the source's, dtype and bytes. The forward of the restored mixed-dtype
params matches transformers' fp32 forward of the same weights (atol 1e-4, as the family tests).
"""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from meshes import fit_pair
from safetensors.torch import load_file

from hybridckpt import jobs, models, naming
from hybridckpt.cli import main
from hybridckpt.jobs.restore import restore
from hybridckpt.mesh import mesh_from_shape

ATOL = 1e-4
TOKENS = np.array([[1, 5, 9, 3, 7, 2, 8, 4], [0, 11, 42, 17, 6, 5, 90, 3]], dtype=np.int32)
MODELS = {
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)),
}  # fmt: skip
MESH_A, MESH_B = fit_pair("fsdp=2,tp=2", "dp=2,tp=4")


def _is_norm(name: str) -> bool:
    return "norm" in name and name.endswith("weight")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """family -> (HF folder saved by transformers: bf16 with fp32 RMSNorm weights, its model)."""
    out = {}
    for seed, (family, (config_cls, model_cls, kw)) in enumerate(MODELS.items()):
        m = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw, attn_implementation="eager"))
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.normal_(1.0 if _is_norm(name) else 0.0, 0.3)
        m = m.to(torch.bfloat16).eval()
        state = {k: (v.float() if _is_norm(k) else v) for k, v in m.state_dict().items()}
        folder = tmp_path_factory.mktemp(family)
        m.save_pretrained(folder, state_dict=state)
        out[family] = (str(folder), m)
    return out


def _load(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, by safetensors' own loader."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out |= load_file(f)
    return out


def _same(got: torch.Tensor | np.ndarray, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bytes."""
    if isinstance(got, np.ndarray):  # numpy (ml_dtypes bf16) -> torch, bytes unchanged
        got = torch.from_numpy(np.ascontiguousarray(got).view(np.uint8).reshape(-1)).view(want.dtype).reshape(got.shape)
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (what, got.dtype, want.dtype)
    assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), what


def _source(folder: str) -> dict[str, torch.Tensor]:
    src = _load(folder)
    kinds = {v.dtype for v in src.values()}
    assert kinds == {torch.bfloat16, torch.float32}, kinds  # not vacuous: both dtypes are there
    assert all((v.dtype == torch.float32) == _is_norm(k) for k, v in src.items())
    return src


@pytest.mark.parametrize("family", list(MODELS))
def test_every_tensor_keeps_its_dtype_import_restore_export(mixed, family, tmp_path):
    """Import onto a tp/fsdp mesh, restore onto another (the store's restore API), export: every
    tensor comes back bit for bit in its own dtype, the fp32 norms fp32, the rest bf16."""
    folder, _ = mixed[family]
    src = _source(folder)
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    s = jobs.import_checkpoint(folder, store, mesh=MESH_A)
    assert not any("cast" in n for n in s.notes), s.notes
    cfg, r = restore(store, MESH_B, optimizer=False)
    leaf = r.params["final_norm"]["scale"]
    assert leaf.dtype == jax.numpy.float32 and leaf.sharding.mesh.shape == mesh_from_shape(MESH_B).shape
    restored = naming.tree_to_hf(jax.tree.map(np.asarray, r.params), cfg)
    assert sorted(restored) == sorted(src)
    for k, want in src.items():
        _same(restored[k].materialize(), want, f"restored {k}")
    jobs.export_checkpoint(store, out)
    got = _load(out)
    assert sorted(got) == sorted(src)
    for k, want in src.items():
        _same(got[k], want, f"exported {k}")
    info = jobs.inspect(store)  # inspect of our store lists each stored array's dtype
    dtypes = {t["name"]: t["dtype"] for t in info["tensors"]}
    assert dtypes["final_norm.scale"] == "float32" and dtypes["embed.embedding"] == "bfloat16"
    assert {t["name"]: t["dtype"] for t in jobs.inspect(folder)["tensors"]}["model.norm.weight"] == "float32"


@pytest.mark.parametrize("family", list(MODELS))
def test_mixed_dtype_params_forward_as_transformers(mixed, family, tmp_path):
    """The restored params, bf16 kernels beside fp32 norm weights, run through the Flax module
    (fp32 compute) and give transformers' fp32 logits of the same weights; `logits` of the store
    too."""
    folder, _ = mixed[family]
    store = str(tmp_path / "store")
    jobs.import_checkpoint(folder, store, mesh=MESH_A)
    cfg, r = restore(store, MESH_B, optimizer=False)
    kinds = {str(x.dtype) for x in jax.tree.leaves(r.params)}
    assert kinds == {"bfloat16", "float32"}, kinds
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    assert theirs.model.norm.weight.dtype == torch.float32
    with torch.no_grad():
        want = theirs.eval()(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    got = np.asarray(jax.jit(lambda p: models.forward(cfg, p, TOKENS))(r.params))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(jobs.logits(store, TOKENS, mesh=MESH_B), want, atol=ATOL, rtol=0)


def test_dtype_float32_casts_the_rest_and_says_what_it_cast(mixed, tmp_path, capsys):
    """`--dtype float32` casts the bf16 tensors, keeps the fp32 ones, and its summary says so
    with the counts; an export with `--dtype bfloat16` casts back, bit for bit with the source's
    bf16 tensors (bf16 -> fp32 -> bf16 is exact), and says it cast every one."""
    folder, _ = mixed["gpt_oss"]
    src = _source(folder)
    n32 = sum(v.dtype == torch.float32 for v in src.values())
    store, out, back = str(tmp_path / "store"), str(tmp_path / "out"), str(tmp_path / "back")
    assert main(["import", folder, store, "--mesh", MESH_A, "--dtype", "float32", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert f"cast {len(src) - n32} tensors bfloat16->float32; {n32} already float32" in said, said
    assert main(["export", store, out, "--quiet"]) == 0
    assert "note: cast" not in capsys.readouterr().out
    for k, v in _load(out).items():
        _same(v, src[k].float(), f"float32 {k}")
    assert main(["export", store, back, "--dtype", "bfloat16", "--quiet"]) == 0
    assert f"cast {len(src)} tensors float32->bfloat16" in capsys.readouterr().out
    got = _load(back)
    for k, want in src.items():
        _same(got[k], want.to(torch.bfloat16), f"bfloat16 {k}")


@pytest.mark.parametrize("to", ["dcp", "torchtitan", "megatron", "maxtext", "paddleformers-unified", "paddlenlp-unified"])
def test_other_export_targets_keep_each_dtype(mixed, to, tmp_path):
    """Every `--to` layout holds per-tensor dtypes: read back (under HF names) each tensor is the
    source's, dtype and bytes."""
    folder, _ = mixed["llama"]
    src = _source(folder)
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    jobs.import_checkpoint(folder, store, mesh=MESH_A)
    jobs.export_checkpoint(store, out, to=to)
    back = jobs.open_checkpoint(out, config=os.path.join(folder, "config.json"))
    params = back.named.params
    assert sorted(params) == sorted(src)
    for k, want in src.items():
        got = params[k].materialize()
        if to == "maxtext" and "q_proj" in k:  # MaxText pre-scales the query kernel in bf16: not
            assert str(got.dtype) == "bfloat16"  # bitwise (docs/maxtext.md), its dtype kept
            continue
        _same(got, want, f"{to} {k}")


def _plain_tree(folder: str) -> dict[str, torch.Tensor]:
    """A model-agnostic torch DCP checkpoint (no config): tensors of four dtypes, written by
    `torch.distributed.checkpoint.save` in this process."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {
        "model.proj.weight": torch.randn(8, 6, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(6, generator=g),
        "model.gate.bias": torch.randn(8, generator=g).to(torch.float16),
        "model.index": torch.arange(12, dtype=torch.int64).reshape(3, 4) * 7,
    }
    dcp.save(state, checkpoint_id=folder)
    return state


def test_a_plain_named_tree_keeps_each_dtype_and_dtype_leaves_integers(tmp_path, capsys):
    """Without a model: each tensor keeps its dtype through import, restore and export; `--dtype
    bfloat16` casts the floating ones only (the int64 stays int64) and counts them."""
    src = _plain_tree(str(tmp_path / "dcp"))
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    jobs.import_checkpoint(str(tmp_path / "dcp"), store, mesh=MESH_A)
    _, r = restore(store, MESH_B, optimizer=False)
    restored = {str(t.dtype) for t in jax.tree.leaves(r.params)}  # (int64 is JAX's int32 without x64)
    assert restored == {"bfloat16", "float32", "float16", str(jax.dtypes.canonicalize_dtype(np.int64))}, restored
    jobs.export_checkpoint(store, out)
    got = _load(out)
    assert sorted(got) == sorted(src)
    for k, want in src.items():
        _same(got[k], want, k)
    cast_store, cast_out = str(tmp_path / "cast"), str(tmp_path / "cast_out")
    assert main(["import", str(tmp_path / "dcp"), cast_store, "--dtype", "bfloat16", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "cast 1 tensor float16->bfloat16; cast 1 tensor float32->bfloat16; 1 already bfloat16; " \
           "1 not floating, kept as stored" in said, said
    jobs.export_checkpoint(cast_store, cast_out)
    got = _load(cast_out)
    for k, want in src.items():
        _same(got[k], want if not want.is_floating_point() else want.to(torch.bfloat16), k)


def test_optimizer_moments_keep_their_dtype_whatever_dtype_casts(mixed, tmp_path, capsys):
    """Moments as our single-card export holds them (`optimizer.safetensors`, written here by
    safetensors), `exp_avg` bf16 and `exp_avg_sq` fp32: `--dtype float32` casts the weights
    only; the moments restore onto another mesh and export in their own dtypes, bit for bit."""
    folder, _ = mixed["llama"]
    src = _source(folder)
    g = torch.Generator().manual_seed(2)
    moments = {f"{k}.exp_avg": torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in src.items()}
    moments |= {f"{k}.exp_avg_sq": torch.rand(v.shape, generator=g) for k, v in src.items()}
    from safetensors.torch import save_file

    with_opt = tmp_path / "with_opt"
    with_opt.mkdir()
    for f in os.listdir(folder):
        os.symlink(os.path.join(folder, f), with_opt / f)
    save_file(moments | {"step": torch.tensor(5, dtype=torch.int64)}, str(with_opt / "optimizer.safetensors"))
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    assert main(["import", str(with_opt), store, "--mesh", MESH_A, "--dtype", "float32", "--quiet"]) == 0
    n32 = sum(v.dtype == torch.float32 for v in src.values())
    assert f"cast {len(src) - n32} tensors bfloat16->float32; {n32} already float32" in capsys.readouterr().out
    cfg, r = restore(store, MESH_B)
    adam = r.opt_state[0]
    assert {str(x.dtype) for x in jax.tree.leaves(adam.mu)} == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(adam.nu)} == {"float32"}
    mu = naming.tree_to_hf(jax.tree.map(np.asarray, adam.mu), cfg)
    for k in src:
        _same(mu[k].materialize(), moments[f"{k}.exp_avg"], f"restored exp_avg {k}")
    jobs.export_checkpoint(store, out, optimizer=True)
    got = load_file(os.path.join(out, "optimizer.safetensors"))
    for k, want in moments.items():
        _same(got[k], want, k)
    assert {v.dtype for k, v in _load(out).items() if not k.endswith(("exp_avg", "exp_avg_sq", "step"))} == {
        torch.float32}


def test_cast_floating_leaves_integers_booleans_and_complex_alone():
    """`--dtype`'s cast (`lazy.dtypes.cast_floating`): real floating tensors only, counted."""
    import ml_dtypes

    from hybridckpt.lazy import ArrayTensor
    from hybridckpt.lazy.dtypes import cast_floating

    arrays = {
        "f8": np.arange(4, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn), "f16": np.ones(3, np.float16),
        "f32": np.full(2, 1 / 3, np.float32), "i": np.arange(3, dtype=np.int64), "b": np.array([True, False]),
        "c": np.array([1 + 2j], np.complex64),
    }  # fmt: skip
    out, report = cast_floating({k: ArrayTensor(v) for k, v in arrays.items()}, "bfloat16")
    got = {k: t.materialize() for k, t in out.items()}
    for k in ("i", "b", "c"):
        assert got[k].dtype == arrays[k].dtype and np.array_equal(got[k], arrays[k]), k
    for k in ("f8", "f16", "f32"):
        assert got[k].dtype == ml_dtypes.bfloat16 and np.array_equal(got[k], arrays[k].astype(ml_dtypes.bfloat16)), k
    assert report.note() == ("cast 1 tensor float16->bfloat16; cast 1 tensor float32->bfloat16; "
                             "cast 1 tensor float8_e4m3fn->bfloat16; 3 not floating, kept as stored")
    assert cast_floating({"x": ArrayTensor(arrays["f32"])}, None)[1].note() is None
