"""Paddle FlexCheckpoint folders (PaddleFormers 1.x `checkpoint-N/`), read without paddle.

Fixtures come from tests/fixtures/flex_writer.py: the metadata dataclasses pickled under Paddle's
own module path and the `.distcp` files written as `paddle.save` writes them, following
`save_state_dict` (dedup of replicated blocks included), from a random fp32 reference Llama in HF
names. Checked once against paddlepaddle 3.3.1 in a side venv (`flex_writer.cross_check_with_paddle`):
`paddle.save` of the metadata paddle loads back from our files is byte-identical to ours, and
`paddle.distributed.load_state_dict` reads our tp2 / sharding v2 / stage3 fixtures to the
reference values. Every import is compared bit for bit with the reference in HF names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from fixtures import flex_writer as fw
from fixtures import paddle_writer as pw
from meshes import cases, fit

from hybridckpt import models, naming
from hybridckpt.containers.pickle.machine import safe_load_file
from hybridckpt.errors import FormatError, UnsafePickleError
from hybridckpt.formats import flex_checkpoint
from hybridckpt.formats import registry as readers
from hybridckpt.formats.flex_checkpoint.metadata import FLEX_POLICY, read_metadata
from hybridckpt.io.byte_source import close_all, count_reads
from hybridckpt.rules import parse_rules

BF16 = np.dtype(ml_dtypes.bfloat16)

VARIANTS = {
    "single_fp32": fw.Options(),
    "tp2_fp32": fw.Options(tp=2),
    "tp2_fp32_safetensors": fw.Options(tp=2, safetensors=True),
    "tp2_stage1v1_bf16_no_model_params": fw.Options(
        tp=2, sharding=2, strategy="stage1", bf16=True, model_without_masters=True
    ),
    "tp2_stage1v2_bf16": fw.Options(tp=2, sharding=2, strategy="v2", bf16=True),
    "stage3_bf16": fw.Options(sharding=2, strategy="stage3", bf16=True, stage3_min=16),
    "v2_replicas": fw.Options(sharding=2, strategy="v2", bf16=True, save_replicas=True),
}


@pytest.fixture(scope="module")
def ref():
    return pw.reference_llama(0)


def write(tmp_path, ref, name):
    ckpt, want = fw.write_output_folder(str(tmp_path / name), ref, VARIANTS[name])
    return ckpt, want


def to_hf(src):
    rules = parse_rules(src.hf_rules, {**models.rule_variables(src.config), **src.rule_vars})
    opt = src.optimizer
    return (
        rules.apply(src.tensors).tensors,
        *(
            rules.apply(t, strict=False).tensors
            for t in (opt.slots["exp_avg"], opt.slots["exp_avg_sq"], opt.master)
        ),
    )


def assert_bitwise(got, want, what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:5])
    for k, v in want.items():
        g = got[k].materialize()
        assert g.dtype == v.dtype and g.shape == v.shape, (
            what,
            k,
            g.dtype,
            v.dtype,
            g.shape,
            v.shape,
        )
        assert np.array_equal(g.view(np.uint8), v.view(np.uint8)), (what, k)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_bitwise(tmp_path, ref, name):
    """Params (bf16 as trained), fp32 masters and both moments under HF names, bit for bit; the
    step from the beta pows; the model dtype kept beside the fp32 optimizer state."""
    ckpt, want = write(tmp_path, ref, name)
    assert readers.detect(ckpt) == "flex-checkpoint"
    src = flex_checkpoint.open(ckpt)
    params, mu, nu, master = to_hf(src)
    assert_bitwise(params, want["params"], "params")
    assert_bitwise(mu, want["exp_avg"], "exp_avg")
    assert_bitwise(nu, want["exp_avg_sq"], "exp_avg_sq")
    assert_bitwise(master, want["master"], "master")
    assert src.optimizer.step == ref.step == src.step
    model_dtypes = {np.dtype(t.dtype) for t in src.tensors.values()}
    assert model_dtypes == ({BF16} if VARIANTS[name].bf16 else {np.dtype(np.float32)})
    assert {np.dtype(t.dtype) for s in src.optimizer.slots.values() for t in s.values()} == {
        np.dtype(np.float32)
    }
    assert src.trainer["lr_scheduler.last_epoch"] == ref.step
    close_all()


def test_layouts_are_what_the_reader_must_undo(tmp_path, ref):
    """The fixtures exercise what the reader handles: Linear weights and moments stored [in, out]
    (not HF's layout), v2 blocks split across ranks with padding, stage3's empty last range, a
    replicated norm stored once, replicas recorded with replica ids."""
    ckpt, _ = write(tmp_path, ref, "tp2_stage1v2_bf16")
    q = "model.layers.0.self_attn.q_proj.weight"
    src = flex_checkpoint.open(ckpt)
    assert src.tensors[q].shape == ref.params[q].shape[::-1]
    opt = read_metadata(os.path.join(ckpt, "optimizer_state"))
    split = [k for k, bs in opt.blocks.items() if len({b.file for b in bs if b.flat}) > 1]
    assert split and all(b.flat is not None for b in opt.blocks[f"{q}.moment1_0"])
    model = read_metadata(os.path.join(ckpt, "model_state"))
    assert len(model.blocks["model.norm.weight"]) == 1  # replicated: stored once
    assert {len(bs) for k, bs in model.blocks.items() if k.endswith("q_proj.weight")} == {2}  # tp
    ckpt3, _ = write(tmp_path, ref, "stage3_bf16")
    raw = safe_load_file(os.path.join(ckpt3, "optimizer_state", "0.metadata"), FLEX_POLICY)
    ranges = [vars(i).get("flattened_range") for i in raw.storage_metadata]
    assert any(r and r[0] == r[1] for r in ranges)  # a rank past the end of a parameter
    ckptr, _ = write(tmp_path, ref, "v2_replicas")
    raw = safe_load_file(os.path.join(ckptr, "model_state", "0.metadata"), FLEX_POLICY)
    assert {vars(i).get("replica_id") for i in raw.storage_metadata} == {0, 1}
    close_all()


def test_a_box_reads_only_its_pieces(tmp_path, ref):
    """A box of a flattened (v2) moment reads only the byte ranges it needs, from the files
    that hold them; opening reads no tensor data."""
    big = pw.reference_llama(5, hidden=64, mlp=128, layers=1)  # pieces past the inline size
    ckpt, want = write(tmp_path, big, "tp2_stage1v2_bf16")
    k = "model.layers.0.mlp.down_proj.weight"  # [mlp, hidden] in Paddle's layout
    with count_reads() as reads:
        src = flex_checkpoint.open(ckpt)
    # opening reads the metadata and the [1] beta pows only (small arrays are inline in pickles)
    assert sum(n for p, n in reads.items() if isinstance(p, str) and p.endswith(".distcp")) < 1024
    t = src.optimizer.slots["exp_avg"][k]
    with count_reads() as reads:
        row = t.read(np.s_[5:6, :])
    assert np.array_equal(row, want["exp_avg"][k].T[5:6, :])
    data = sum(n for p, n in reads.items() if isinstance(p, str) and p.endswith(".distcp"))
    assert 0 < data < t.nbytes // 4, data
    close_all()


def test_model_params_rebuilt_from_masters_keep_the_model_dtype(tmp_path, ref):
    """Paddle #76538's bug was the fp32 optimizer state overwriting the model params' dtype when
    both load at once. Here each tensor's dtype is its own: params missing from model_state are
    rebuilt from the masters as bf16 (the config's dtype), equal to the masters rounded."""
    ckpt, want = write(tmp_path, ref, "tp2_stage1v1_bf16_no_model_params")
    assert not read_metadata(os.path.join(ckpt, "model_state")).blocks
    src = flex_checkpoint.open(ckpt)
    assert any("rebuilt from fp32 master weights cast to bfloat16" in n for n in src.notes)
    params, _, _, master = to_hf(src)
    assert_bitwise(params, want["params"], "params")
    assert all(t.dtype == np.float32 for t in master.values())
    close_all()


def test_trainer_state_betas_and_config_lookup(tmp_path, ref):
    """trainer_state.bin (a pickled TrainerState, read as a stub) gives the step; betas from
    training_args.bin decide the step read off the beta pows; config.json comes from the output
    folder above; a bare folder without one opens model-agnostic and `--config` maps it."""
    from hybridckpt import jobs

    ckpt, _ = fw.write_output_folder(str(tmp_path / "run"), ref, fw.Options())
    fw.dump_object(
        {"global_step": 11, "epoch": 0.5, "log_history": []},
        os.path.join(ckpt, "trainer_state.bin"),
        "paddleformers.trainer.trainer_callback",
        "TrainerState",
    )
    fw.dump_object(
        {"adam_beta1": 0.8, "adam_beta2": 0.99},
        os.path.join(ckpt, "training_args.bin"),
        "paddleformers.trainer.training_args",
        "TrainingArguments",
    )
    for key, beta in ((".beta1_pow_acc_0", 0.8), (".beta2_pow_acc_0", 0.99)):
        fw.rewrite_scalars(os.path.join(ckpt, "optimizer_state"), key, pw.beta_pow(beta, 5))
    src = flex_checkpoint.open(ckpt)
    assert (
        src.step == 11 and src.optimizer.step == 5 and src.optimizer.hyper["betas"] == [0.8, 0.99]
    )
    assert src.trainer["epoch"] == 0.5 and src.config is not None
    bare = tmp_path / "bare"
    shutil.copytree(ckpt, bare)
    opened = jobs.open_checkpoint(str(bare))
    assert opened.config is None and "model.layers.0.self_attn.q_proj.weight" in opened.named.params
    opened = jobs.open_checkpoint(str(bare), config=str(tmp_path / "run" / "config.json"))
    assert opened.named.params["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    close_all()


def test_step_is_not_guessed_from_wrong_betas(tmp_path, ref):
    """A run with betas 0.8 / 0.95 and no training_args.bin: 0.95 ** 4 reads as 204 steps of
    Paddle's default 0.999 (seen on a checkpoint Paddle 3.3.1 wrote); beta1's accumulator is no
    power of 0.9, so the step is left unknown instead."""
    ckpt, _ = fw.write_output_folder(str(tmp_path / "run"), ref, fw.Options())
    for key, beta in ((".beta1_pow_acc_0", 0.8), (".beta2_pow_acc_0", 0.95)):
        fw.rewrite_scalars(os.path.join(ckpt, "optimizer_state"), key, pw.beta_pow(beta, 3))
    from hybridckpt.formats.paddle.optimizer import step_from_beta_pow

    assert step_from_beta_pow(float(pw.beta_pow(0.95, 3)[0]), 0.999) == 204
    src = flex_checkpoint.open(ckpt)
    assert src.optimizer.step is None and any("optimizer step unknown" in n for n in src.notes)
    close_all()


@pytest.mark.parametrize(
    "name,mesh_a,mesh_b",
    cases([
        ("tp2_stage1v2_bf16", "fsdp=2,tp=2,pp=2", "dp=2,tp=4"),
        ("stage3_bf16", "tp=4,pp=2", "fsdp=8"),
    ]),
)
def test_import_restore_export_bitwise(tmp_path, ref, name, mesh_a, mesh_b):
    """FlexCheckpoint -> Orbax on mesh A -> restore on mesh B -> export: the fp32 masters (what
    bf16 training steps) and both moments bit for bit, the step from the beta pows."""
    from e2e import assert_same, roundtrip

    ckpt, want = write(tmp_path, ref, name)
    params, mu, nu, step = roundtrip(ckpt, str(tmp_path), mesh_a=mesh_a, mesh_b=mesh_b)
    assert_same(params, want["master"])
    assert_same(mu, want["exp_avg"], "exp_avg")
    assert_same(nu, want["exp_avg_sq"], "exp_avg_sq")
    assert step == ref.step


def test_logits_equal_transformers(tmp_path, ref):
    """The imported fp32 model's logits equal transformers' LlamaForCausalLM on the reference."""
    import torch
    import transformers

    from hybridckpt import jobs

    ckpt, _ = write(tmp_path, ref, "tp2_fp32")
    jobs.import_checkpoint(ckpt, str(tmp_path / "orbax"), mesh=fit("fsdp=2,tp=2,pp=2"))
    cfg = transformers.LlamaConfig(**{k: v for k, v in ref.config.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ref.params.items()}, strict=False)
    tokens = np.array([[3, 17, 49, 0, 42, 7, 10, 5]], dtype=np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = jobs.logits(str(tmp_path / "orbax"), tokens, mesh=fit("dp=2,tp=4"))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    wrong = naming.source_named(flex_checkpoint.open(ckpt)).params  # [in, out], not transposed
    assert (
        wrong["model.layers.0.mlp.up_proj.weight"].shape
        != ref.params["model.layers.0.mlp.up_proj.weight"].shape
    )


# -- damaged input ------------------------------------------------------------------------------


def _damage(ckpt, how):
    opt = os.path.join(ckpt, "optimizer_state")
    if how == "truncated distcp":
        p = os.path.join(opt, "1_0.distcp")
        data = open(p, "rb").read()
        open(p, "wb").write(data[: len(data) // 2])
        return r"1_0\.distcp"
    if how == "missing distcp":
        os.remove(os.path.join(opt, "1_0.distcp"))
        return r"1_0\.distcp: missing; .*0\.metadata stores"
    if how == "metadata not a pickle":
        open(os.path.join(opt, "0.metadata"), "wb").write(b"not a pickle at all")
        return r"optimizer_state/0\.metadata"
    if how == "metadata runs code":
        open(os.path.join(opt, "0.metadata"), "wb").write(b"\x80\x04cos\nsystem\n(S'echo hi'\ntR.")
        return r"0\.metadata.*os\.system"
    if how == "flattened ranges leave a gap":
        fw.edit_metadata(opt, lambda md: fw.shift_first_flat_range(md))
        return r"0\.metadata: .*(flattened pieces|no entry|leave elements|overlap|end at element)"
    if how == "shape differs from the metadata":
        fw.edit_metadata(opt, lambda md: fw.grow_first_block(md))
        return r"0\.metadata|\.distcp"
    if how == "missing metadata":
        os.remove(os.path.join(opt, "0.metadata"))
        return r"optimizer_state: no \{id\}\.metadata"
    raise AssertionError(how)


DAMAGE = [
    "truncated distcp",
    "missing distcp",
    "metadata not a pickle",
    "metadata runs code",
    "flattened ranges leave a gap",
    "shape differs from the metadata",
    "missing metadata",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_damage_is_one_line_naming_the_file(tmp_path, ref, how):
    """The reader raises a project error naming the file (and key); the CLI prints one line and
    exits 2, writing nothing."""
    ckpt, _ = write(tmp_path, ref, "tp2_stage1v2_bf16")
    match = _damage(ckpt, how)
    with pytest.raises(FormatError, match=match) as e:
        src = readers.open_source(ckpt, "flex-checkpoint")
        for t in (
            *src.tensors.values(),
            *(v for s in src.optimizer.slots.values() for v in s.values()),
        ):
            t.materialize()
    if how == "metadata runs code":
        assert isinstance(e.value, UnsafePickleError)
    close_all()
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "hybridckpt.cli", "export", ckpt, str(out), "--optimizer"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


def test_inspect_lists_the_format(tmp_path, ref):
    from hybridckpt import jobs

    ckpt, _ = write(tmp_path, ref, "tp2_fp32")
    info = jobs.inspect(ckpt)
    assert info["format"] == "flex-checkpoint"
    json.dumps(info)
    close_all()


def test_fuzzed_metadata_is_a_project_error_or_reads(tmp_path, ref):
    """Random byte changes in a `.metadata` pickle: every outcome is a clean read or one of the
    project's errors (never a Python exception from inside the reader)."""
    from hybridckpt.errors import HybridCkptError

    ckpt, _ = write(tmp_path, ref, "tp2_stage1v2_bf16")
    path = os.path.join(ckpt, "optimizer_state", "0.metadata")
    good = open(path, "rb").read()
    rng = np.random.default_rng(0)
    outcomes = {"read": 0, "error": 0}
    for _ in range(150):
        data = bytearray(good)
        for i in rng.integers(0, len(data), size=int(rng.integers(1, 4))):
            data[i] = int(rng.integers(0, 256))
        open(path, "wb").write(bytes(data))
        try:
            src = flex_checkpoint.open(ckpt)
            for s in src.optimizer.slots.values():
                for t in s.values():
                    t.materialize()
            outcomes["read"] += 1
        except HybridCkptError:
            outcomes["error"] += 1
        close_all()
    assert outcomes["error"] > 0, outcomes
