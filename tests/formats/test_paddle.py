"""PaddleNLP checkpoints: paddle.save pickles, hybrid-parallel folders, unified checkpoints.

Fixtures come from tests/fixtures/paddle_writer.py: numpy + pickle written exactly as paddle.save
writes them (byte-identical to paddlepaddle 3.3.1's output for the same tensors; see the
writer's `cross_check_with_paddle`), from a random fp32 reference Llama in HF names split
FORWARD by the writer's own rules. Every import is compared bit for bit with the reference in
HF names: params (bf16 where the run was bf16), fp32 master weights and both Adam moments.
"""

import json
import math
import os
import pickle
import shutil

import ml_dtypes
import numpy as np
import pytest
from fixtures import paddle_writer as pw
from meshes import cases

from hybridckpt import lazy, models, naming
from hybridckpt.containers.pickle import paddle_save
from hybridckpt.errors import FormatError, MappingError, UnsafePickleError
from hybridckpt.formats import paddle
from hybridckpt.formats import registry as readers
from hybridckpt.formats.paddle import unified as paddle_unified
from hybridckpt.formats.paddle.write_unified import write_unified
from hybridckpt.io.byte_source import count_reads
from hybridckpt.models import config_from_hf
from hybridckpt.rules import parse_rules

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def refs():
    return {
        "plain": pw.reference_llama(0),
        "tied": pw.reference_llama(1, tied=True),
        "vocab66": pw.reference_llama(2, vocab=66),
    }


def hf_rules_of(src):
    return parse_rules(src.hf_rules, {**models.rule_variables(src.config), **src.rule_vars})


def to_hf(src):
    """(params, exp_avg, exp_avg_sq, master) of a source in HF names (strict for params)."""
    rules = hf_rules_of(src)
    params = rules.apply(src.tensors).tensors
    opt = src.optimizer
    moments = [
        rules.apply(m, strict=False).tensors
        for m in (opt.slots["exp_avg"], opt.slots["exp_avg_sq"], opt.master)
    ]
    return (params, *moments)


def assert_bitwise(got, want, what):
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))}"
    for k, v in want.items():
        g = got[k].materialize()
        assert g.dtype == v.dtype, f"{what} {k}: {g.dtype} != {v.dtype}"
        assert g.shape == v.shape, f"{what} {k}: {g.shape} != {v.shape}"
        assert np.array_equal(g.view(np.uint8), v.view(np.uint8)), f"{what} {k} differs"


VARIANTS = {
    "tp1": dict(),
    "tp2": dict(tp=2),
    "tp4_kv_replicated": dict(tp=4),
    "pp2": dict(pp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_pp2_stage1v1_bf16": dict(tp=2, pp=2, sharding=2, strategy="stage1", bf16=True),
    "tp2_pp2_stage1v1_bf16_no_model_state": dict(
        tp=2, pp=2, sharding=2, strategy="stage1", bf16=True, sharded_model=True, model_state=False
    ),
    "tp2_pp2_stage1v2_bf16_no_model_state": dict(
        tp=2, pp=2, sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False
    ),
    "tp2_stage1v2_fp32_sharded_model": dict(tp=2, sharding=4, strategy="v2", sharded_model=True),
    "stage1v2_paddle2_meta_dtypes": dict(
        sharding=2,
        strategy="v2",
        bf16=True,
        sharded_model=True,
        model_state=False,
        meta_dtype_ints=dict(pw.PADDLE2_DTYPE),
    ),
    "tp2_stage2_bf16": dict(tp=2, sharding=2, strategy="stage2", bf16=True),
    "stage3_bf16": dict(sharding=4, strategy="stage3", bf16=True),
    "tp2_fused_qkv_ffn_bf16": dict(tp=2, fuse_attn=True, fuse_ffn=True, bf16=True),
    "pp2_fused_stage1v1": dict(pp=2, sharding=2, strategy="stage1", fuse_attn=True, fuse_ffn=True),
    "protocol2_big_params": dict(tp=2, protocol=2, big_elements=100),
    "protocol3_big_params_bf16": dict(protocol=3, big_elements=300, bf16=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hybrid_variants_bitwise(tmp_path, refs, name):
    ref = refs["plain"]
    opts = pw.Options(**VARIANTS[name])
    pw.write_hybrid(str(tmp_path), ref, opts)
    assert readers.detect(str(tmp_path)) == "paddle"
    src = paddle.open(str(tmp_path))
    assert src.topology == {"tp": opts.tp, "pp": opts.pp, "sharding": opts.sharding}
    # the source layout differs from HF: Paddle kernels are [in, out]
    q = (
        "llama.layers.0.self_attn.qkv_proj.weight"
        if opts.fuse_attn
        else "llama.layers.0.self_attn.q_proj.weight"
    )
    hf_q = ref.params["model.layers.0.self_attn.q_proj.weight"]
    assert src.tensors[q].shape != hf_q.shape or not np.array_equal(
        src.tensors[q].materialize().astype(np.float32), hf_q
    )
    params, m1, m2, master = to_hf(src)
    want = pw.expected(ref, opts.bf16)
    assert_bitwise(params, want["params"], "params")
    assert_bitwise(m1, want["exp_avg"], "exp_avg")
    assert_bitwise(m2, want["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise(master, want.get("master", {}), "master")
    assert src.optimizer.step == ref.step and src.step == ref.step
    assert src.trainer["lr_scheduler"] == {"last_epoch": ref.step, "last_lr": 0.001}
    if not opts.model_state:
        assert any("rebuilt from fp32 master weights" in n for n in src.notes)


@pytest.mark.parametrize(
    "key,opts",
    [
        ("tied", dict(tp=2)),  # single card: lm_head.weight is the embedding parameter (one name)
        ("tied", dict(tp=2, pp=2)),  # the last stage keeps its own copy
        (
            "tied",
            dict(tp=2, pp=2, raw_pp_names=True, sharding=2, strategy="stage1", sharded_model=True),
        ),
        ("vocab66", dict(tp=4)),  # vocab % tp != 0: embedding and lm_head replicated
    ],
    ids=["tied_tp2", "tied_tp2_pp2", "tied_raw_pipeline_names", "vocab_not_divisible"],
)
def test_tied_and_replicated_vocab(tmp_path, refs, key, opts):
    ref = refs[key]
    o = pw.Options(**opts)
    pw.write_hybrid(str(tmp_path), ref, o)
    if o.raw_pp_names:
        raw = paddle_save.read(str(tmp_path / "model_state.tp00_pp01_shard00.pdparams")).names
        meta = json.loads((tmp_path / "model_meta.json").read_text())
        keys = list(raw) + list(meta["sharding_metas"]["tp00_pp01"]["structure_name_mapping"])
        assert any(k.startswith("_layers.") for k in keys)
    src = paddle.open(str(tmp_path))
    params, m1, m2, _ = to_hf(src)
    want = pw.expected(ref, False)
    assert_bitwise(params, want["params"], "params")
    assert_bitwise(m1, want["exp_avg"], "exp_avg")
    assert_bitwise(m2, want["exp_avg_sq"], "exp_avg_sq")


def test_v2_fixture_exercises_padding_and_cross_rank_params(tmp_path, refs):
    """The stage1 v2 fixture really splits params over ranks, with padding in the slices."""
    ref = refs["plain"]
    pw.write_hybrid(
        str(tmp_path),
        ref,
        pw.Options(sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False),
    )
    meta = json.loads((tmp_path / "model_meta.json").read_text())["sharding_metas"]["tp00_pp00"]
    pieces: dict[str, list[int]] = {}
    for r in range(2):
        d = paddle_save.read(str(tmp_path / f"optimizer.shard{r:02d}.pdopt"))
        assert d.tuple_form and "master_weights" in d.children
        for k, t in d.tensors.items():
            if k.endswith("_moment1_0"):
                assert t.ndim == 1
                pieces.setdefault(k.split("_fp32_master")[0], []).append(t.shape[0])
    by_param = {v: k for k, v in meta["structure_name_mapping"].items()}
    numel = {p: math.prod(meta["param_meta"][by_param[p]][0]) for p in pieces}
    assert any(len(v) == 2 for v in pieces.values())
    assert any(sum(v) > numel[p] for p, v in pieces.items())
    empty = tmp_path / "model_state.shard00.pdparams"  # bf16 params with masters are not saved
    assert os.path.getsize(empty) == 47 and paddle_save.read(str(empty)).tensors == {}


def test_flat_rebuild_is_lazy_and_reads_only_its_box(tmp_path):
    """v2 params rebuilt from 1-D slices (Concat -> Slice -> Reshape over payloads left in the
    pickles) read only the bytes of the requested box."""
    ref = pw.reference_llama(3, hidden=64, mlp=128, heads=4, kv_heads=4)
    pw.write_hybrid(
        str(tmp_path),
        ref,
        pw.Options(sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False),
    )
    src = paddle.open(str(tmp_path))
    name = "llama.layers.0.mlp.up_proj.weight"  # [64, 128] fp32 master, split over both ranks
    t = src.optimizer.master[name]
    assert isinstance(t, lazy.Reshape)
    want = ref.params["model.layers.0.mlp.up_proj.weight"].T
    with count_reads() as c:
        got = t.read((slice(10, 12), slice(None)))
    assert np.array_equal(got, want[10:12])
    assert sum(v for k, v in c.items() if not isinstance(k, tuple)) == 2 * 128 * 4


def test_paddle_save_forms(tmp_path):
    """Which dict gets which form (Paddle's `_is_state_dict`) and what the reader makes of it."""
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    bits = np.arange(4, dtype=np.float32).astype(BF16)
    # state dict form: arrays + name table; an LR_Scheduler dict keeps that form (paddle 3.3.1)
    pw.paddle_save(
        {"w": pw.PTensor("linear_0.w_0", a), "LR_Scheduler": {"last_epoch": 2}},
        str(tmp_path / "s.pdopt"),
    )
    d = paddle_save.read(str(tmp_path / "s.pdopt"))
    assert (
        not d.tuple_form
        and d.names == {"w": "linear_0.w_0"}
        and d.extra == {"LR_Scheduler": {"last_epoch": 2}}
    )
    assert np.array_equal(d.tensors["w"].materialize(), a)
    # nested tensors (master_weights) switch to the (name, ndarray) tuple form, no name table
    pw.paddle_save(
        {"m": pw.PTensor("m_0", a), "master_weights": {"p": pw.PTensor("p_fp32_master_0", a)}},
        str(tmp_path / "t.pdopt"),
    )
    assert b"builtins" in (tmp_path / "t.pdopt").read_bytes()
    d = paddle_save.read(str(tmp_path / "t.pdopt"))
    assert (
        d.tuple_form
        and d.names == {"m": "m_0"}
        and d.children["master_weights"].names == {"p": "p_fp32_master_0"}
    )
    # bf16 is stored as uint16 bits; the model reader views them as bfloat16
    pw.paddle_save({"b": pw.PTensor("b_0", bits)}, str(tmp_path / "b.pdparams"))
    t = paddle_save.read(str(tmp_path / "b.pdparams")).tensors["b"]
    assert t.dtype == np.uint16
    assert (
        np.array_equal(paddle.as_model_dtype(t).materialize(), bits)
        and paddle.as_model_dtype(t).dtype == BF16
    )
    # empty state dict: 47 bytes, no tensors
    pw.paddle_save({}, str(tmp_path / "e.pdparams"))
    assert os.path.getsize(tmp_path / "e.pdparams") == 47
    assert paddle_save.read(str(tmp_path / "e.pdparams")).tensors == {}


def test_big_params_join_lazily(tmp_path):
    big = np.arange(5000, dtype=np.float32).reshape(50, 100)
    pw.paddle_save(
        {"big": pw.PTensor("x", big)}, str(tmp_path / "p3.pdparams"), protocol=3, big_elements=1500
    )
    raw = paddle_save.safe_load(str(tmp_path / "p3.pdparams"))
    assert sorted(raw) == [
        "StructuredToParameterName@@",
        "UnpackBigParamInfor@@",
        "big@@.0",
        "big@@.1",
        "big@@.2",
        "big@@.3",
    ]
    t = paddle_save.read(str(tmp_path / "p3.pdparams")).tensors["big"]
    assert isinstance(t, lazy.Reshape) and np.array_equal(t.materialize(), big)
    with count_reads() as c:
        assert np.array_equal(t.read((slice(20, 21),)), big[20:21])
    assert sum(v for k, v in c.items() if not isinstance(k, tuple)) == 100 * 4


def test_single_pdparams_file(tmp_path, refs):
    ref = refs["plain"]
    pw.write_hybrid(str(tmp_path), ref, pw.Options(bf16=True))
    src = readers.open_source(str(tmp_path / "model_state.pdparams"))
    params = hf_rules_of(src).apply(src.tensors).tensors
    assert_bitwise(params, pw.expected(ref, True)["params"], "params")


def test_step_from_beta_pows():
    for step in (0, 1, 3, 500, 5000, 60000):
        b1, b2 = pw.beta_pow(0.9, step), pw.beta_pow(0.999, step)
        assert np.array_equal(paddle.beta_pow(0.9, step), b1) and np.array_equal(
            paddle.beta_pow(0.999, step), b2
        )
        assert paddle.optimizer_step([float(b1[0])] * 2, [float(b2[0])] * 2, (0.9, 0.999)) == step
    assert paddle.optimizer_step([0.0], [0.0], (0.9, 0.999)) is None
    assert paddle.step_from_beta_pow(0.5, 0.9) is None  # not a power of beta


def test_step_not_guessed_from_assumed_betas():
    """Betas 0.8 / 0.95 with no training_args.bin: beta2's accumulator alone reads as 204 steps of
    Paddle's default 0.999 (a real Paddle 3.3.1 save after 3 steps); with the defaults assumed
    both accumulators must agree, so the step is left unknown. With the run's betas read, beta1
    alone decides."""
    b1, b2 = float(pw.beta_pow(0.8, 3)[0]), float(pw.beta_pow(0.95, 3)[0])
    assert paddle.optimizer_step([b1], [b2], (0.9, 0.999)) == 204  # the trap, betas taken as read
    assert paddle.optimizer_step([b1], [b2], (0.9, 0.999), betas_read=False) is None
    assert paddle.optimizer_step([b1], [b2], (0.8, 0.95), betas_read=False) == 3


# -- rules round trips ------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,fuse",
    [("plain", False), ("plain", True), ("tied", False), ("tied", True)],
    ids=["plain", "fused", "tied", "tied_fused"],
)
def test_hf_rules_round_trip(refs, key, fuse):
    ref = refs[key]
    src = pw.to_paddle(ref, ref.params, fuse_attn=fuse, fuse_ffn=fuse)
    if ref.tied:
        src.pop("lm_head.weight")  # the tied copy is deleted on import; the inverse cannot make it
    cfg = config_from_hf(ref.config)
    rules = paddle.hf_rules(cfg, fuse_qkv=fuse, fuse_ffn=fuse)
    tensors = {k: lazy.ArrayTensor(v) for k, v in src.items()}
    res = rules.apply(tensors)
    # the shared decoder rules also name biases and q/k norms, which Llama does not have
    absent = ("lm_head", ".bias", "q_norm", "k_norm")
    assert not res.unconsumed and not [r for r in res.unused if not any(a in r.text for a in absent)]
    assert_bitwise(res.tensors, ref.params, "hf")
    back = rules.invert().apply(res.tensors).tensors
    assert_bitwise(back, src, "paddle")


# -- unified checkpoints ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,bf16,fuse",
    [("plain", True, False), ("tied", False, False), ("plain", True, True)],
    ids=["bf16", "tied_fp32", "fused_bf16"],
)
def test_unified_import_and_export(tmp_path, refs, key, bf16, fuse):
    ref = refs[key]
    pw.write_unified_fixture(str(tmp_path / "in"), ref, bf16=bf16, fuse_attn=fuse, fuse_ffn=fuse)
    assert readers.detect(str(tmp_path / "in")) == "paddle-unified"
    src = paddle_unified.open(str(tmp_path / "in"))
    params, m1, m2, master = to_hf(src)
    want = pw.expected(ref, bf16)
    assert_bitwise(params, want["params"], "params")
    assert_bitwise(m1, want["exp_avg"], "exp_avg")
    assert_bitwise(m2, want["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise(master, want.get("master", {}), "master")
    assert src.optimizer.step == ref.step
    # export from HF names; the files equal the fixture's tensor for tensor, bf16 as U16
    out = str(tmp_path / "out")
    write_unified(
        out,
        params,
        config=src.config,
        slots={"exp_avg": m1, "exp_avg_sq": m2},
        master=master if bf16 else None,
        step=src.optimizer.step,
        fuse_attention_qkv=fuse,
        fuse_attention_ffn=fuse,
        max_shard_bytes=30000,
    )
    for index in ("model", "optimizer") + (("master_weights",) if bf16 else ()):
        a = paddle_unified.read_indexed(str(tmp_path / "in"), f"{index}.safetensors.index.json")
        b = paddle_unified.read_indexed(out, f"{index}.safetensors.index.json")
        assert_bitwise(b, {k: v.materialize() for k, v in a.items()}, index)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        first = sorted(set(json.load(f)["weight_map"].values()))[0]
    header = json.loads(open(os.path.join(out, first), "rb").read()[8:].split(b"}}", 1)[0] + b"}}")
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == ({"U16"} if bf16 else {"F32"})
    again = paddle_unified.open(out)
    assert again.optimizer.step == ref.step


def test_unified_not_confused_with_hf(tmp_path):
    from safetensors.numpy import save_file

    save_file(
        {"model.embed_tokens.weight": np.zeros((2, 2), np.float32)},
        str(tmp_path / "model-00001-of-00001.safetensors"),
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"},
            }
        )
    )
    assert not paddle_unified.detect(str(tmp_path))


# -- the imported model computes the reference loss -------------------------------------------


def test_loss_of_imported_model_equals_reference(tmp_path, refs):
    from functools import partial

    import jax
    import jax.numpy as jnp

    from hybridckpt import models

    ref = refs["plain"]
    pw.write_hybrid(
        str(tmp_path),
        ref,
        pw.Options(
            tp=2, pp=2, sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False
        ),
    )
    src = paddle.open(str(tmp_path))
    cfg = src.config
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, size=(2, 12)).astype(np.int32)
    imported = naming.hf_to_tree(naming.source_to_hf(src, cfg), cfg)
    reference = naming.hf_to_tree(
        naming.Named({k: lazy.ArrayTensor(v) for k, v in ref.params.items()}), cfg
    )

    loss_fn = jax.jit(partial(models.loss, cfg))

    def loss(named):
        tree = naming.nest({k: jnp.asarray(v.materialize()) for k, v in named.params.items()})
        return float(loss_fn(tree, jnp.asarray(tokens)))

    got, want = loss(imported), loss(reference)
    assert math.isfinite(got) and got == want
    # the bf16 params themselves (not the masters) give a loss near, but not at, the reference
    bf16_params = naming.hf_to_tree(
        naming.Named(hf_rules_of(src).apply(src.tensors).tensors), cfg
    )
    rounded = loss(
        naming.Named({k: lazy.cast(v, np.float32) for k, v in bf16_params.params.items()})
    )
    assert rounded != want and abs(rounded - want) < 1e-2


# -- bad input -------------------------------------------------------------------------------


def test_missing_shard_file_is_named(tmp_path, refs):
    pw.write_hybrid(
        str(tmp_path), refs["plain"], pw.Options(tp=2, sharding=2, strategy="stage1", bf16=True)
    )
    os.remove(tmp_path / "optimizer.tp01_shard01.pdopt")
    with pytest.raises(FormatError, match=r"optimizer\.tp01_shard01\.pdopt"):
        paddle.open(str(tmp_path))


def test_missing_model_state_without_meta_is_named(tmp_path, refs):
    pw.write_hybrid(str(tmp_path), refs["plain"], pw.Options(tp=2))
    os.remove(tmp_path / "model_state.tp01.pdparams")
    with pytest.raises(FormatError, match=r"model_state\.tp01\.pdparams"):
        paddle.open(str(tmp_path))


def _rewrite(path, fn):
    with open(path, "rb") as f:
        obj = pickle.load(f, encoding="latin1")  # our own fixture file
    fn(obj)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=4)


def test_v2_slices_that_do_not_add_up(tmp_path, refs):
    pw.write_hybrid(
        str(tmp_path),
        refs["plain"],
        pw.Options(sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False),
    )
    path = tmp_path / "optimizer.shard01.pdopt"
    victim = {}

    def cut(obj):
        for k, v in obj.items():
            if k.endswith("_moment1_0") and v[1].shape[0] > 300:
                obj[k] = (v[0], v[1][:10])
                victim["key"] = k
                return

    _rewrite(path, cut)
    with pytest.raises(FormatError) as e:
        paddle.open(str(tmp_path))
    assert "optimizer.shard01.pdopt" in str(e.value) and victim["key"] in str(e.value)


def test_mixed_sharding_strategies(tmp_path, refs):
    ref = refs["plain"]
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    pw.write_hybrid(str(v1), ref, pw.Options(tp=2, sharding=2, strategy="stage1", bf16=True))
    pw.write_hybrid(str(v2), ref, pw.Options(tp=2, sharding=2, strategy="v2", bf16=True))
    for r in range(2):
        shutil.copy(
            v2 / f"optimizer.tp01_shard{r:02d}.pdopt", v1 / f"optimizer.tp01_shard{r:02d}.pdopt"
        )
    with pytest.raises(
        FormatError, match=r"mixed sharding strategies.*optimizer\.tp0[01]_shard0[01]\.pdopt"
    ):
        paddle.open(str(v1))
    meta_dir = tmp_path / "meta"
    pw.write_hybrid(
        str(meta_dir),
        ref,
        pw.Options(
            tp=2, sharding=2, strategy="v2", bf16=True, sharded_model=True, model_state=False
        ),
    )
    meta = json.loads((meta_dir / "model_meta.json").read_text())
    meta["sharding_metas"]["tp01_pp00"]["sharding_strategy"] = "ShardingV1"
    (meta_dir / "model_meta.json").write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=r"model_meta\.json.*mixed sharding strategies"):
        paddle.open(str(meta_dir))


def test_name_with_no_mapping_is_refused(tmp_path, refs):
    pw.write_hybrid(str(tmp_path), refs["plain"], pw.Options(tp=2))
    src = paddle.open(str(tmp_path))
    extra = {**src.tensors, "llama.mystery_gate.weight": lazy.ArrayTensor(np.zeros(3, np.float32))}
    with pytest.raises(MappingError, match="llama.mystery_gate.weight"):
        hf_rules_of(src).apply(extra)


def test_accumulator_of_unknown_param_is_named(tmp_path, refs):
    pw.write_hybrid(str(tmp_path), refs["plain"], pw.Options(tp=2))
    path = tmp_path / "optimizer.tp01.pdopt"
    _rewrite(path, lambda obj: obj.__setitem__("linear_99.w_0_moment1_0", np.zeros(2, np.float32)))
    with pytest.raises(FormatError, match=r"optimizer\.tp01\.pdopt.*linear_99\.w_0_moment1_0"):
        paddle.open(str(tmp_path))


def test_unsafe_and_broken_pickles(tmp_path):
    evil = tmp_path / "evil.pdparams"
    evil.write_bytes(
        b"\x80\x04\x95\x1a\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x02id\x85R."
    )
    with pytest.raises(UnsafePickleError, match="os.system"):
        paddle_save.read(str(evil))
    pw.paddle_save(
        {"w": pw.PTensor("w", np.zeros((64, 64), np.float32))}, str(tmp_path / "ok.pdparams")
    )
    data = (tmp_path / "ok.pdparams").read_bytes()
    (tmp_path / "cut.pdparams").write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="cut.pdparams"):
        paddle_save.read(str(tmp_path / "cut.pdparams"))


@pytest.mark.parametrize(
    "name,mesh_a,mesh_b",
    cases([("tp2_pp2_stage1v2_bf16_no_model_state", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"), ("tp2_fused_qkv_ffn_bf16", "tp=4,pp=2", "fsdp=8")]),
)
def test_import_restore_export_bitwise(tmp_path, refs, name, mesh_a, mesh_b):
    """Hybrid-parallel Paddle -> Orbax on mesh A -> restore on mesh B -> export: the reference (the
    fp32 master weights are what gets imported when the run kept them)."""
    from e2e import assert_same, roundtrip

    ref = refs["plain"]
    opts = pw.Options(**VARIANTS[name])
    src = str(tmp_path / "paddle")
    pw.write_hybrid(src, ref, opts)
    want = pw.expected(ref, opts.bf16)
    params, mu, nu, step = roundtrip(src, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, want.get("master") or want["params"])
    assert_same(mu, {k: v for k, v in want["exp_avg"].items()}, "exp_avg")
    assert_same(nu, {k: v for k, v in want["exp_avg_sq"].items()}, "exp_avg_sq")
    assert step == ref.step
