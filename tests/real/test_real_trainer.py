"""Training folders written by transformers' Trainer, accelerate and DeepSpeed themselves
(tests/real/generators/hf_trainer.py: 2 CPU gloo ranks, 3 AdamW steps saved, a fourth taken),
against references from the tools' runtime.

Each case: import on mesh A, restore on mesh B, export: params and moments bit for bit equal to
what the runtime held after step 3; the logits of the imported model equal transformers' forward
(fp32, atol 2e-5); the optax optimizer rebuilt from the hyper-parameters the import recorded
(`restore(..., optimizer="from-checkpoint")`: lr, betas, eps, weight decay and the Trainer's
no-decay group as a mask) takes one step from the imported state with the gradient the tool's
fourth step consumed and lands on the tool's params after that step (relative 1e-5); the same step
with the count one off, or without the mask, does not.
"""

from __future__ import annotations

import os

import cases
import jax
import numpy as np
import pytest
from e2e import optax_init, optax_step

from hybridckpt import jobs, naming
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.jobs.restore import restore
from hybridckpt.store.manager import CheckpointStore

ZERO2 = "hf_trainer_deepspeed_zero2"
CASES = {  # case -> (checkpoint folder inside ckpt/, the case holding its references, format)
    "hf_trainer_fsdp2_sharded": ("checkpoint-3", "hf_trainer_fsdp2_sharded", "hf-trainer"),
    "hf_trainer_fsdp2_full": ("checkpoint-3", "hf_trainer_fsdp2_full", "hf-trainer"),
    ZERO2: ("checkpoint-3", ZERO2, "hf-trainer"),
    "deepspeed_universal_zero2": ("", ZERO2, "deepspeed-universal"),
    "accelerate_fsdp2_full_save_state": ("checkpoint-3", "accelerate_fsdp2_full_save_state", "hf-trainer"),
}


def _src(case: str) -> str:
    return cases.ckpt(case, CASES[case][0]) if CASES[case][0] else cases.ckpt(case)


def _config(case: str) -> str | None:
    """The universal checkpoint carries no config: the run's, given as --config."""
    return cases.ckpt(ZERO2, "checkpoint-3", "config.json") if case == "deepspeed_universal_zero2" else None


def _refs(case: str, kind: str) -> dict[str, np.ndarray]:
    ref = cases.reference(CASES[case][1])
    return {k[len(kind) + 1:]: v for k, v in ref.items() if k.startswith(kind + "/")}


def meshes() -> tuple[str, str]:
    """Two different meshes over the devices present (kv heads 2: tp <= 2), fitted by
    `meshes.fit_pair`: on 8 devices fsdp=2,tp=2,pp=2 then dp=4,tp=2; on 1 both dp=1."""
    from meshes import fit_pair

    return fit_pair("fsdp=2,tp=2,pp=2", "dp=4,tp=2")


@pytest.fixture(scope="module", params=sorted(CASES))
def imported(request, tmp_path_factory):
    from e2e import roundtrip

    case = request.param
    work = tmp_path_factory.mktemp(case)
    a, b = meshes()
    out = roundtrip(_src(case), str(work), mesh_a=a, mesh_b=b, config=_config(case))
    return case, str(work), out


def _bitwise(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:5])
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.float32 and g.shape == w.shape, (what, k, g.dtype, g.shape)
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (what, k)


def test_detected_as_the_trainer_layer():
    for case, (_, _, fmt) in CASES.items():
        assert detect(_src(case)) == fmt, case


def test_params_and_moments_bitwise(imported):
    case, _, (params, mu, nu, step) = imported
    _bitwise(params, _refs(case, "param"), "params")
    _bitwise(mu, _refs(case, "exp_avg"), "exp_avg")
    _bitwise(nu, _refs(case, "exp_avg_sq"), "exp_avg_sq")
    assert [step] == cases.manifest(CASES[case][1])["optimizer_step"] == [3]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case):
    ref = cases.reference(CASES[case][1])
    got = jobs.logits(_src(case), ref["tokens"], mesh=meshes()[1], config=_config(case))
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=2e-5)
    assert np.abs(ref["logits"]).max() > 0.1


def _groups(case: str) -> tuple[dict, set[str]]:
    """(group 0's hyper-parameters, the names of the no-decay group) as torch held them."""
    groups = cases.manifest(CASES[case][1])["hyper"]
    assert len(groups) == 2 and groups[1]["weight_decay"] == 0.0 < groups[0]["weight_decay"]
    return groups[0], set(groups[1]["names"])


def test_hyper_parameters_recorded(imported):
    case, work, _ = imported
    h0, no_decay = _groups(case)
    with CheckpointStore(os.path.join(work, "orbax")) as store:
        state = store.trainer_state(3)
    hyper = state["optimizer_hyper"]
    assert hyper["lr"] == h0["lr"] and hyper["eps"] == h0["eps"] and hyper["betas"] == h0["betas"]
    assert hyper["weight_decay"] == h0["weight_decay"]
    # the no-decay group (the Trainer's norms) as a mask over the stacked leaves
    cfg = jobs.open_checkpoint(os.path.join(work, "orbax")).config
    mask = state["weight_decay_mask"]
    undecayed = {n for leaf, d in mask.items() if not d
                 for n in naming.tree_to_hf({leaf: np.zeros(s) for leaf, s in _leaf_shapes(cfg, leaf)}, cfg)}
    assert undecayed == no_decay
    # inspect shows them, and the export writes them back under HF names
    info = jobs.inspect(_src(case), config=_config(case))["optimizer"]
    assert info["hyper"]["lr"] == h0["lr"] and len(info["param_groups"]) == 2
    back = open_source(os.path.join(work, "exported")).optimizer.hyper
    assert back["lr"] == h0["lr"] and set(back["groups"][1]["params"]) == no_decay


def _leaf_shapes(cfg, leaf: str):
    from hybridckpt import models

    return [(leaf, naming.flatten(models.param_shape_tree(cfg))[leaf])]


def _step(work: str, grads_hf: dict, count_delta: int = 0, mask: bool = True) -> dict[str, np.ndarray]:
    """One step of the optimizer rebuilt from the checkpoint, from the state restored on mesh B."""
    import optax

    cfg, r = restore(os.path.join(work, "orbax"), meshes()[1], optimizer="from-checkpoint")
    tx = r.tx
    state = r.opt_state
    if not mask:  # the negative control: every param decays
        h = r.trainer_state["optimizer_hyper"]
        tx = optax.adamw(h["lr"], b1=h["betas"][0], b2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"])
        state = (state[0], *optax_init(tx, r.params)[1:])
    if count_delta:
        state = (state[0]._replace(count=state[0].count + count_delta), *state[1:])
    from hybridckpt import lazy

    grads = naming.hf_to_tree(naming.Named({k: lazy.ArrayTensor(v) for k, v in grads_hf.items()}), cfg).params
    gtree = jax.tree.map(lambda p, g: jax.numpy.asarray(g.materialize(), p.dtype),
                         r.params, naming.nest(grads))
    after = optax_step(tx, gtree, state, r.params)
    return {k: v.materialize() for k, v in naming.tree_to_hf(jax.tree.map(np.asarray, after), cfg).items()}


def test_next_step_equals_the_tools_fourth(imported):
    case, work, (params, _, _, _) = imported
    want = _refs(case, "param_next")
    got = _step(work, _refs(case, "grad"))
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-7, err_msg=k)
        assert not np.allclose(w, params[k], rtol=1e-5, atol=1e-7), k  # every param moved
    # negative controls: the count one off; weight decay on the Trainer's no-decay norms
    for wrong in (_step(work, _refs(case, "grad"), count_delta=1), _step(work, _refs(case, "grad"), mask=False)):
        assert not all(np.allclose(wrong[k], want[k], rtol=1e-5, atol=1e-7) for k in want)


def test_config_source_said():
    """FSDP SHARDED_STATE_DICT writes no config.json into checkpoint-3: the output folder's is
    read and said; the DeepSpeed variant has its own; an output folder reads its latest step."""
    sharded = open_source(cases.ckpt("hf_trainer_fsdp2_sharded", "checkpoint-3"))
    assert not os.path.exists(cases.ckpt("hf_trainer_fsdp2_sharded", "checkpoint-3", "config.json"))
    assert sharded.trainer["config_source"].startswith("the output folder's config.json")
    assert sharded.config is not None and sharded.step == 3
    ds = open_source(cases.ckpt(ZERO2, "checkpoint-3"))
    assert ds.trainer["config_source"].startswith("the checkpoint folder's config.json")
    assert ds.trainer["lr"] == 0.01 and ds.trainer["trainer_layout"] == "deepspeed"
    top = open_source(cases.ckpt("hf_trainer_fsdp2_sharded"))
    assert top.step == 3 and any("checkpoint-3" in n for n in top.notes)


def test_universal_cat_dim_recorded():
    """ds_to_universal keeps, per tensor, the dim its tensor-parallel slices join on: recorded
    for every param it gives one (here tp 1: dim 0, as DeepSpeed's default merge says)."""
    src = open_source(cases.ckpt("deepspeed_universal_zero2"))
    cuts = src.trainer["universal_cut"]
    assert set(cuts) == set(src.tensors) and {c["cat_dim"] for c in cuts.values()} == {0}
    assert src.trainer["source_parallel"] == {"pp_degree": 1, "tp_degree": 1}
