"""Paddle checkpoints written by the trainers themselves: PaddleFormers 1.2
(tests/real/generators/paddleformers.py) and PaddleNLP 3.0.0b4 (generators/paddlenlp.py).

Each case is one training run saved as a FlexCheckpoint (`ckpt/flex/checkpoint-3`, PaddleFormers'
default), PaddleNLP's legacy `model_state.pdparams` + `optimizer.pdopt` (`ckpt/legacy/`) and/or a
unified checkpoint (`ckpt/unified/checkpoint-3`); the references come from Paddle's
runtime (the manifest's SHA-256 digests of every param, master, moment in HF layout; Paddle's
fp32 logits; the next step's gradients and weights). Checked:
- import onto a mesh -> restore on another -> export (`--to hf`): the fp32 weights (masters of a
  bf16 run) and both moments bit for bit, the step; the 16-bit params as stored, bit for bit;
- logits of the import against Paddle's own fp32 forward (atol 1e-4 on logits of order one; a
  different run's logits are far outside it);
- one optax AdamW step from the exported state with Paddle's gradients against Paddle's own AdamW
  step (relative 1e-5); with a wrong step count (2, not 3) the same comparison fails;
- `export --to paddleformers-unified` / `paddlenlp-unified` against the unified checkpoint the
  tool wrote: every tensor bit for bit (beta pows to 1 ulp: Paddle multiplies them up step by
  step);
- what PaddleFormers 1.2 writes that cannot be read is refused in one line: the per-rank pieces of
  a sharding stage1 v2 unified save.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np
import pytest
from cases import all_cases, case_dir, ckpt, manifest, reference
from e2e import roundtrip

import hybridckpt
from hybridckpt.errors import FormatError
from hybridckpt.formats import flex_checkpoint
from hybridckpt.formats import registry as readers
from hybridckpt.formats.paddle import unified as paddle_unified

PADDLE = [c for c in all_cases() if c.startswith(("paddleformers_", "paddlenlp_")) and not c.startswith("paddleformers_ernie")]  # ERNIE: test_real_paddle_ernie.py
DETECTED = {"flex": "flex-checkpoint", "unified": "paddle-unified", "legacy": "paddle"}
READABLE = [
    (c, f)
    for c in PADDLE
    for f in manifest(c)["formats"]
    if not (f == "unified" and manifest(c)["run"]["par"] == "sharding2")
]
LOGITS_ATOL = 1e-4  # fp32 forward, Paddle's kernels against XLA's; the logits are of order one
STEP_RTOL = 1e-5
EMBEDDING = "model.embed_tokens.weight"


def meshes() -> tuple[str, str]:
    """Two different meshes of the devices present (a real reshard between them); on one device
    both are dp=1."""
    n = jax.device_count()
    if n >= 8:
        return "fsdp=2,tp=2,pp=2", "dp=2,tp=4"
    if n >= 4:
        return "tp=2,pp=2", "fsdp=4"
    if n >= 2:
        return "tp=2", "fsdp=2"
    return "dp=1", "dp=1"  # one device: the same path, the layout unchanged


def src(case: str, fmt: str) -> str:
    return ckpt(case, *manifest(case)["formats"][fmt].split("/")[1:])


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def assert_digests(got: dict, want: dict, what: str) -> None:
    """`got` (name -> array, HF layout) is bit for bit the runtime tensor whose digest is `want`."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    bad = [k for k in want if digest(got[k]) != want[k]["sha256"] or list(np.shape(got[k])) != want[k]["shape"]]
    assert not bad, f"{what}: not Paddle's runtime values: {bad}"


def weights_digests(m: dict) -> dict:
    """The digests of what an import holds as params: the fp32 masters of a bf16 run."""
    return m["digests"]["master"] or m["digests"]["params"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(case, fmt) -> (orbax folder, exported params, exp_avg, exp_avg_sq, step), computed once."""
    done: dict = {}

    def get(case, fmt):
        if (case, fmt) not in done:
            work = tmp_path_factory.mktemp(f"{case}-{fmt}")
            mesh_a, mesh_b = meshes()
            done[case, fmt] = (str(work / "orbax"), *roundtrip(src(case, fmt), str(work), mesh_a=mesh_a, mesh_b=mesh_b))
        return done[case, fmt]

    return get


def test_corpus_has_the_paddleformers_runs():
    """The generator's runs are all here, each saying what it holds."""
    assert len(PADDLE) == 6, PADDLE
    for c in PADDLE:
        m = manifest(c)
        if c.startswith("paddleformers_"):
            assert m["versions"]["paddleformers"].startswith("1.2.") and m["versions"]["paddlepaddle"] == "3.3.1"
        else:
            assert m["versions"]["paddlenlp"] == "3.0.0b4" and m["versions"]["paddlepaddle"] == "3.0.0"
        assert m["steps"] == 3 and m["formats"], c


@pytest.mark.parametrize("case,fmt", READABLE)
def test_import_restore_export_bitwise(imported, case, fmt):
    """Import on mesh A, restore on mesh B, export: Paddle's runtime values bit for bit."""
    m = manifest(case)
    assert readers.detect(src(case, fmt)) == DETECTED[fmt]
    _, params, mu, nu, step = imported(case, fmt)
    assert_digests(params, weights_digests(m), "params")
    assert_digests(mu, m["digests"]["exp_avg"], "exp_avg")
    assert_digests(nu, m["digests"]["exp_avg_sq"], "exp_avg_sq")
    assert step == m["steps"]


@pytest.mark.parametrize("case,fmt", [(c, f) for c, f in READABLE if manifest(c)["run"]["prec"] == "bf16"])
def test_sixteen_bit_params_as_stored(case, fmt):
    """A bf16 run: its bf16 params, as the files hold them, are Paddle's bit for bit (the import
    takes the masters in their place)."""
    m = manifest(case)
    opened = {"flex": flex_checkpoint.open, "unified": paddle_unified.open}[fmt](src(case, fmt))
    transposed = tuple(m["transposed"]) if fmt == "flex" else ()  # flex keeps Paddle's [in, out]
    got = {
        k: np.ascontiguousarray(t.materialize().T) if k.endswith(transposed) else t.materialize()
        for k, t in opened.tensors.items()
    }
    assert all(v.dtype.name == "bfloat16" for v in got.values())
    if m["run"]["tied"] and "lm_head.weight" in got:  # the unified files list the tied weight twice
        head = got.pop("lm_head.weight")
        assert np.array_equal(head.view(np.uint16), got["model.embed_tokens.weight"].view(np.uint16))
    assert_digests(got, m["digests"]["params"], "bf16 params")


@pytest.mark.parametrize("case,fmt", READABLE)
def test_logits_equal_paddles_forward(imported, case, fmt):
    """The imported model's fp32 logits equal Paddle's own forward of the same weights."""
    ref = reference(case)
    got = hybridckpt.logits(imported(case, fmt)[0], ref["tokens"], mesh=meshes()[1])
    assert np.abs(ref["logits"]).max() > 0.5
    np.testing.assert_allclose(got, ref["logits"], atol=LOGITS_ATOL, rtol=0)
    other = reference(next(c for c in PADDLE if c != case))["logits"]  # another run's weights
    assert np.abs(got - other).max() > 100 * LOGITS_ATOL


def adamw_step(params, mu, nu, grads, count, hyper):
    """One optax AdamW step (Paddle's decoupled decay on `hyper["decay"]` only) -> new params."""
    import optax

    tx = optax.adamw(
        hyper["lr"], b1=hyper["betas"][0], b2=hyper["betas"][1], eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], mask={k: k in set(hyper["decay"]) for k in params},
    )
    state = tx.init(params)
    state = (state[0]._replace(count=np.int32(count), mu=mu, nu=nu), *state[1:])
    updates, _ = tx.update(grads, state, params)
    return {k: np.asarray(v) for k, v in optax.apply_updates(params, updates).items()}


@pytest.mark.parametrize("case,fmt", READABLE)
def test_next_step_equals_paddles(imported, case, fmt):
    """From the imported state (weights, moments, step) and Paddle's gradients, one optax AdamW
    step gives Paddle's AdamW step (relative 1e-5); the step count matters (2 instead of 3 fails)."""
    m, ref = manifest(case), reference(case)
    _, params, mu, nu, step = imported(case, fmt)
    grads = {k: ref[f"grad:{k}"] for k in params}
    want = {k: ref[f"next:{k}"] for k in params}

    def close(got):
        return all(np.allclose(got[k], want[k], rtol=STEP_RTOL, atol=STEP_RTOL * np.abs(want[k]).max()) for k in want)

    got = adamw_step(params, mu, nu, grads, step, m["hyper"])
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=STEP_RTOL, atol=STEP_RTOL * np.abs(want[k]).max(), err_msg=k)
    assert not close(adamw_step(params, mu, nu, grads, step - 1, m["hyper"]))
    assert any(not np.array_equal(params[k], want[k]) for k in want)  # the step moved the weights


@pytest.mark.parametrize("case", [c for c, f in READABLE if f == "unified"])
def test_export_unified_is_what_the_tool_wrote(imported, tmp_path, case):
    """`export --to paddleformers-unified` of the import writes the unified checkpoint
    PaddleFormers wrote: the same tensors under the same keys, bit for bit (the beta pows, which
    Paddle multiplies up step by step and we compute as beta ** (step + 1), within 1 ulp). A tied
    model's state is under `lm_head.weight` (as one rank writes it; 2 ranks also write the same
    values under the embedding's name)."""
    m = manifest(case)
    orbax = imported(case, "unified")[0]
    out = str(tmp_path / "export")
    dtype = "bfloat16" if m["run"]["prec"] == "bf16" else None
    layout = "paddlenlp-unified" if case.startswith("paddlenlp_") else "paddleformers-unified"
    hybridckpt.export_checkpoint(orbax, out, optimizer=True, to=layout, dtype=dtype)
    theirs = src(case, "unified")
    for index in ("model", "optimizer", "master_weights"):
        path = os.path.join(theirs, f"{index}.safetensors.index.json")
        want = paddle_unified.read_indexed(theirs, f"{index}.safetensors.index.json") if os.path.isfile(path) else {}
        got = paddle_unified.read_indexed(out, f"{index}.safetensors.index.json")
        assert set(got) <= set(want), (index, sorted(set(got) - set(want))[:6])
        for k in set(want) - set(got):  # 2 ranks, tied: the state under both names, the same
            head = "lm_head.weight" + k[len(EMBEDDING):]
            assert m["run"]["tied"] and k.startswith(EMBEDDING) and head in got, (index, k)
            assert np.array_equal(want[k].materialize(), want[head].materialize()), (index, k)
        for k, t in ((k, want[k]) for k in got):
            a, b = got[k].materialize(), t.materialize()
            assert a.dtype == b.dtype and a.shape == b.shape, (index, k, a.dtype, b.dtype, a.shape, b.shape)
            if "_pow_acc_" in k:
                np.testing.assert_array_max_ulp(a, b, maxulp=1)
            else:
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (index, k)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(theirs, "config.json")) as f:
        theirs_cfg = json.load(f)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert cfg[key] == theirs_cfg[key], key


def test_sharding_v2_unified_pieces_refused():
    """PaddleFormers 1.2 under sharding stage1 v2 (its default `split_param`) writes each rank's
    padded 1-D slices of the moments and masters (it cannot be told to gather them): refused in
    one line naming the file, the param, what it holds and what was expected."""
    case = "paddleformers_untied_bf16_sharding2"
    path = src(case, "unified")
    raw = paddle_unified.read_indexed(path, "optimizer.safetensors.index.json")
    assert raw["model.embed_tokens.weight/moment1_0"].shape == (64 * 32,)
    with pytest.raises(FormatError, match=r"optimizer\.safetensors\.index\.json: 'model\.embed_tokens\.weight' is a 1-D piece of 2048 elements for a param of shape \(64, 32\).*gather_split_param"):
        paddle_unified.open(path)
    assert os.path.isdir(os.path.join(case_dir(case), "ckpt", "flex"))  # the same run reads as flex
