"""Checkpoints written by Megatron-LM / megatron-core 0.19.2 itself (tests/real/generators/
megatron_core.py, on gloo CPU ranks), against references from Megatron's own runtime.

Each case: import on mesh A, restore on mesh B, export; the params and Adam moments equal, bit for
bit, those a tp = pp = 1 Megatron model holds after loading the same state (the reference run);
the logits of the imported model equal GPTModel's own forward on fixed tokens (fp32, atol 2e-5:
a 2-layer model of hidden 16, both sides fp32, different reduction orders); one optax AdamW step
from the imported state with the gradients Megatron's next step consumed equals the params after
Megatron's own step (relative 1e-5), and the same step with the count off by one does not.
Cases: the dense state (tp2 pp2 dp2) as dp_reshardable, fully_reshardable and the legacy torch
format; MoE (SequentialMLP) on tp2 pp2 ep2, its optimizer chained [dense, experts]; MoE with
ep 1 (tp1 pp2 dp2), one optimizer holding the experts in its dense buffers. The MoE references
come from ranks at tp = pp = 1 (two at ep 2: the chained optimizer loads only into the same
chain), their optimizer slices joined by the generator.
"""

from __future__ import annotations

import cases
import jax
import numpy as np
import optax
import pytest
from e2e import optax_init, optax_step
from megatron_reference import assert_bitwise, assert_logits_equal_megatron, to_hf

DENSE = "megatron_core_dense_dp_reshardable"
MOE = "megatron_core_moe_sequential_dp_reshardable"  # ep 2: chained [dense, experts] optimizer
MOE_EP1 = "megatron_core_moe_ep1_dp_reshardable"  # ep 1: one optimizer, experts in its buffers
CASES = {  # case -> the case holding its references (the same trained state)
    DENSE: DENSE,
    "megatron_core_dense_fully_reshardable": DENSE,
    "megatron_lm_dense_torch": DENSE,
    MOE: MOE,
    MOE_EP1: MOE_EP1,
}
DIMS = {"vocab": 60, "heads": 4, "groups": 2}


def meshes(case: str = DENSE) -> tuple[str, str]:
    """Two different meshes over the devices present (the tiny model: kv heads 2, so tp <= 2;
    the ep 1 case's 2 experts, which `dp` shards, dp <= 2); on one device both are dp=1."""
    n = jax.device_count()
    if n >= 8:
        return "fsdp=2,tp=2,pp=2", "dp=2,fsdp=2,tp=2" if case == MOE_EP1 else "dp=4,tp=2"
    if n >= 4:
        return "tp=2,pp=2", "fsdp=2,tp=2"
    if n >= 2:
        return "tp=2", "fsdp=2"
    return "dp=1", "dp=1"  # one device: the same path, the layout unchanged


def expected(case: str, kind: str) -> dict[str, np.ndarray]:
    return to_hf(cases.reference(CASES[case]), kind, **DIMS)


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    from e2e import roundtrip

    case = request.param
    a, b = meshes(case)
    out = roundtrip(cases.ckpt(case), str(tmp_path_factory.mktemp(case)), mesh_a=a, mesh_b=b)
    return case, out


def test_params_and_moments_bitwise(exported):
    case, (params, mu, nu, step) = exported
    assert_bitwise(params, expected(case, "param"), "params")
    assert_bitwise(mu, expected(case, "exp_avg"), "exp_avg")
    assert_bitwise(nu, expected(case, "exp_avg_sq"), "exp_avg_sq")
    assert [step] == cases.manifest(CASES[case])["optimizer_step"] == [3]


def test_masters_are_the_params():
    """fp32 training: the generator checked the DistributedOptimizer's main params equal the model
    params bit for bit (so importing the weights imports the masters)."""
    for case in (DENSE, MOE, MOE_EP1):
        assert cases.manifest(case)["master_equals_param"] is True


@pytest.mark.parametrize("case", [DENSE, MOE, MOE_EP1])
def test_bucket_masters_are_the_weights(case):
    """fp32 training: the DistributedOptimizer's fp32 main params are the model params, so the
    masters the reader places in the dp_reshardable buckets equal the weights it reads from the
    model keys, bit for bit: a check of the bucket walk that needs no reference (the MoE local
    spec's pre-MLP norm placed after the router swapped their masters and moments)."""
    from hybridckpt.formats.registry import open_source

    src = open_source(cases.ckpt(case))
    master = src.optimizer.master
    assert sorted(master) == sorted(src.tensors)
    for k, t in src.tensors.items():
        w, m = t.materialize(), master[k].materialize()
        assert w.dtype == m.dtype == np.float32 and w.shape == m.shape, k
        assert np.array_equal(w.view(np.uint32), m.view(np.uint32)), k


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_megatron_forward(case):
    assert_logits_equal_megatron(cases.ckpt(case), cases.reference(CASES[case]), DIMS["vocab"], meshes(case)[1])


def _optax_step(params, mu, nu, grads, count: int, man: dict) -> dict[str, np.ndarray]:
    """One optax.adamw step with Megatron's param group 0 hyperparameters; no weight decay on the
    parameters Megatron's optimizer put in its no-decay group (norms)."""
    h = man["hyper"]
    no_wd = set(to_hf({f"x/{n}": np.zeros(1) for n in man["no_weight_decay"]}, "x", **{**DIMS, "vocab": 1}))
    p = {k: jax.numpy.asarray(v) for k, v in params.items()}
    tx = optax.adamw(
        h["lr"], b1=h["betas"][0], b2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"],
        mask={k: k not in no_wd for k in p},
    )  # fmt: skip
    state = optax_init(tx, p)
    adam = state[0]._replace(count=jax.numpy.asarray(count, jax.numpy.int32),
                             mu={k: jax.numpy.asarray(mu[k]) for k in p},
                             nu={k: jax.numpy.asarray(nu[k]) for k in p})  # fmt: skip
    after = optax_step(tx, {k: jax.numpy.asarray(grads[k]) for k in p}, (adam, *state[1:]), p)
    return {k: np.asarray(v) for k, v in after.items()}


def test_next_step_equals_megatron_step(exported):
    case, (params, mu, nu, step) = exported
    man = cases.manifest(CASES[case])
    assert man["optimizer_class"] == "torch.optim.adamw.AdamW" and man["hyper"]["weight_decay"] > 0
    grads, after = expected(case, "grad"), expected(case, "param_next")
    got = _optax_step(params, mu, nu, grads, step, man)
    moved = 0
    for k, want in after.items():
        np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-7, err_msg=k)
        moved += not np.allclose(want, params[k], rtol=1e-5, atol=1e-7)
    assert moved == len(after)  # every parameter took a step
    # negative control: the same step with the count one off is not Megatron's
    wrong = _optax_step(params, mu, nu, grads, step + 1, man)
    assert not all(np.allclose(wrong[k], after[k], rtol=1e-5, atol=1e-7) for k in after)


def test_moe_expert_keys_are_megatrons():
    """megatron-core writes a routed expert's weights under `...mlp.experts.experts.linear_fc1.
    weight` (the MoE layer's `experts.` and SequentialMLP's own), layer and global expert axes
    prepended: what the reader must take apart (rules/megatron_dist_experts.rules)."""
    from hybridckpt.containers.dcp_metadata import read_metadata

    md = read_metadata(cases.ckpt(MOE, "iter_0000003"))
    shapes = {k: tuple(e.shape) for k, e in md.tensors.items() if ".experts." in k}
    assert shapes == {
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 16, 16),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 16, 8),
    }
    assert tuple(md.tensors["decoder.layers.mlp.router.weight"].shape) == (2, 4, 16)


def test_moe_optimizer_chains():
    """megatron-core chains an experts' optimizer only for expert-parallel experts (ep > 1 or an
    expert tp other than tp: optimizer/__init__.py, tensor_parallel/layers.py `allreduce`): the ep 2
    save's bucket keys are `chained_0.` (dense domains tp x pp) and `chained_1.` (expert domains
    tp x ep x pp), the ep 1 save's carry no chain and hold the experts in the dense buffers."""
    from hybridckpt.containers.dcp_metadata import read_metadata
    from hybridckpt.formats.megatron_dist.buckets import BUCKET

    def domains(case):
        md = read_metadata(cases.ckpt(case, "iter_0000003"))
        found = [m for m in map(BUCKET.match, md.tensors) if m]
        return {(m["chain"] or "", int(m["g"])) for m in found}

    assert domains(MOE) == {("chained_0.", g) for g in range(4)} | {("chained_1.", g) for g in range(8)}
    assert domains(MOE_EP1) == {("", 0), ("", 1)}  # tp 1 x pp 2


@pytest.mark.parametrize("case", [DENSE, "megatron_core_dense_fully_reshardable"])
def test_hyper_parameters_and_the_rebuilt_optimizer(case, tmp_path):
    """What Megatron recorded (its param groups: lr, betas, eps, weight decay; the no-decay group
    of megatron-core's default rule, 1-D params and biases) is recorded at import, and the optax
    optimizer `restore(optimizer="from-checkpoint")` rebuilds from it takes Megatron's next step;
    without the no-decay mask it does not."""
    from hybridckpt import jobs, lazy, models, naming
    from hybridckpt.jobs.restore import restore

    man = cases.manifest(CASES[case])
    ckpt = str(tmp_path / "orbax")
    jobs.import_checkpoint(cases.ckpt(case), ckpt, mesh=meshes(case)[0])
    cfg, r = restore(ckpt, meshes(case)[1], optimizer="from-checkpoint")
    hyper = r.trainer_state["optimizer_hyper"]
    assert {k: hyper[k] for k in ("lr", "eps", "weight_decay")} == {k: man["hyper"][k] for k in ("lr", "eps", "weight_decay")}
    assert hyper["betas"] == man["hyper"]["betas"]
    undecayed = set()
    shapes = naming.flatten(models.param_shape_tree(cfg))
    for leaf, decays in r.trainer_state["weight_decay_mask"].items():
        if not decays:
            undecayed |= set(naming.tree_to_hf({leaf: np.zeros(shapes[leaf], np.float32)}, cfg))
    want = set(to_hf({f"x/{n}": np.zeros(1) for n in man["no_weight_decay"]}, "x", **{**DIMS, "vocab": 1}))
    assert undecayed == want

    grads = naming.hf_to_tree(naming.Named({k: lazy.ArrayTensor(v) for k, v in expected(case, "grad").items()}), cfg)
    g = jax.tree.map(lambda p, t: jax.numpy.asarray(t.materialize(), p.dtype), r.params, naming.nest(grads.params))

    def step(tx, state):
        out = optax_step(tx, g, state, r.params)
        return {k: v.materialize() for k, v in naming.tree_to_hf(jax.tree.map(np.asarray, out), cfg).items()}

    after = expected(case, "param_next")
    got = step(r.tx, r.opt_state)
    for k, w in after.items():
        np.testing.assert_allclose(got[k], w, rtol=1e-5, atol=1e-7, err_msg=k)
    h = hyper
    plain = optax.adamw(h["lr"], b1=h["betas"][0], b2=h["betas"][1], eps=h["eps"], weight_decay=h["weight_decay"])
    wrong = step(plain, (r.opt_state[0], *optax_init(plain, r.params)[1:]))
    assert not all(np.allclose(wrong[k], after[k], rtol=1e-5, atol=1e-7) for k in after)
