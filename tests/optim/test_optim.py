"""Optimizer state as declared slots: relations, the plan's shardings, and a second optimizer
(torch SGD with momentum) carried end to end, next step included, through one module."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from meshes import abstract_mesh, fit_pair

from hybridckpt import naming, optim, plan
from hybridckpt.cli import main
from hybridckpt.errors import CheckpointError

# -- declarations ------------------------------------------------------------------------------------


def test_relations_give_shapes_and_specs():
    R = optim.Relation
    assert R.PARAM.shape((4, 6, 8)) == (4, 6, 8) and R.SCALAR.shape((4, 6)) == ()
    assert R.ROW.shape((4, 6, 8)) == (4, 6) and R.COLUMN.shape((4, 6, 8)) == (4, 8)
    assert R.ROW.spec(("pp", "fsdp", "tp")) == ("pp", "fsdp")
    assert R.COLUMN.spec(("pp", "fsdp", "tp")) == ("pp", "tp")
    assert R.ROW.shape((5,)) == (5,)  # a vector's factored statistics are the vector


def test_optimizers_are_found_by_their_slots():
    assert optim.for_slots({"exp_avg", "exp_avg_sq"}).name == "adamw"
    assert optim.for_slots(["momentum_buffer"]).name == "sgd"
    assert optim.get("adamw").orbax_prefix("exp_avg") == "0.mu." and optim.get("adamw").orbax_step == "0.count"
    assert not optim.get("sgd").has_step and optim.get("sgd").orbax_step is None
    with pytest.raises(CheckpointError, match=r"\['exp_avg', 'max_exp_avg_sq'\] matches no known optimizer"):
        optim.for_slots({"exp_avg", "max_exp_avg_sq"})


def _factored() -> optim.Optimizer:
    """An Adafactor-like optimizer, declared in a test: row and column statistics of the second
    moment, plus a step. Nothing else needs to know it."""

    def make_state(params):
        row = jax.tree.map(lambda p: jnp.zeros(p.shape[:-1] if p.ndim > 1 else p.shape, jnp.float32), params)
        col = jax.tree.map(lambda p: jnp.zeros(p.shape[:-2] + p.shape[-1:] if p.ndim > 1 else p.shape, jnp.float32), params)
        return ({"count": jnp.zeros((), jnp.int32), "row": row, "col": col},)

    return optim.Optimizer(
        "factored-test",
        (optim.Slot("v_row", "row", optim.Relation.ROW), optim.Slot("v_col", "col", optim.Relation.COLUMN)),
        {"v_row": (0, "row"), "v_col": (0, "col"), "step": (0, "count")},
        make_state,
    )


def test_plan_shards_each_slot_by_its_relation():
    mesh = abstract_mesh("fsdp=2,tp=2,pp=2")  # the rule alone: the same specs on any device count
    shapes = {"w": jax.ShapeDtypeStruct((4, 6, 8), np.float32), "b": jax.ShapeDtypeStruct((6,), np.float32)}
    p = plan.for_named(shapes, mesh, optimizer=_factored())
    # generic rule: fsdp on the largest dim it divides (8), tp on the largest remaining (6)
    assert p.param_shardings["w"].spec == P(None, "tp", "fsdp")
    row, col = p.slot_shardings("v_row")["w"], p.slot_shardings("v_col")["w"]
    assert row.spec == P(None, "tp") and col.spec == P(None, "fsdp")
    t = p.opt_targets()[0]
    assert t["row"]["w"].shape == (4, 6) and t["col"]["w"].shape == (4, 8) and t["count"].shape == ()
    assert t["count"].sharding.spec == P()


def test_generic_rule_prefers_the_largest_divisible_dims():
    mesh = abstract_mesh("fsdp=2,tp=4")
    assert plan.generic_spec((6, 16), mesh) == P(None, "fsdp")  # 4 does not divide 6
    assert plan.generic_spec((16, 8), mesh) == P("fsdp", "tp")
    assert plan.generic_spec((3, 5), mesh) == P(None, None)
    assert plan.generic_spec((), mesh) == P()


# -- SGD with momentum, end to end --------------------------------------------------------------------

LR, MOMENTUM = 0.05, 0.9


@pytest.fixture(scope="module")
def sgd_dcp(tmp_path_factory):
    """A tiny HF Llama trained 2 steps by torch.optim.SGD(momentum=0.9), saved by torch's DCP
    (`no_dist=True`) as `get_state_dict` lays it out (FQN keys), with config.json beside it; and
    torch's next step on the same batch (grads and params), the reference for optax."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from fixtures.torch_common import lm_step, next_step, perturbed_llama, token_batch
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)
    model = perturbed_llama(cfg, seed=0, scale=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    batch = token_batch(96, (2, 10), seed=1)
    lm_step(model, opt, batch)
    lm_step(model, opt, batch)
    names = {p: n for n, p in model.named_parameters()}
    state = {names[p]: {"momentum_buffer": s["momentum_buffer"].clone()} for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} | {"params": [names[p] for p in g["params"]]}
              for g in opt.param_groups]
    sd = {"model": {k: v.clone() for k, v in model.state_dict().items()},
          "optim": {"state": state, "param_groups": groups}}
    root = tmp_path_factory.mktemp("sgd")
    src = root / "dcp"
    dcp.save(sd, checkpoint_id=str(src), no_dist=True)
    (src / "config.json").write_text(json.dumps(cfg.to_dict()))
    grads, after = next_step(model, opt, batch)
    ref = {
        "param": {k: v.numpy() for k, v in sd["model"].items()},
        "buf": {k: v["momentum_buffer"].numpy() for k, v in state.items()},
        "grad": {n: g.numpy() for n, g in grads.items()},
        "next": {n: p.numpy() for n, p in after.items()},
    }
    return str(src), ref, root


def test_sgd_momentum_imports_restores_steps_and_exports(sgd_dcp, capsys):
    import optax

    from hybridckpt import jobs
    from hybridckpt.containers.safetensors_file import read_header
    from hybridckpt.jobs.restore import restore

    src, ref, root = sgd_dcp
    info = jobs.inspect(src)
    assert info["optimizer"]["name"] == "sgd" and info["optimizer"]["slots"] == ["momentum_buffer"]
    ckpt = str(root / "ckpt")
    mesh_a, mesh_b = fit_pair("fsdp=2,tp=2,pp=2", "tp=4,pp=2")
    s = jobs.import_checkpoint(src, ckpt, mesh=mesh_a)
    assert s.with_optimizer
    cfg, r = restore(ckpt, mesh_b)
    trace = r.opt_state[0].trace  # optax.sgd's TraceState, restored onto another mesh
    assert trace["layers"]["q"]["kernel"].sharding == r.params["layers"]["q"]["kernel"].sharding
    got = naming.tree_to_hf(jax.tree.map(np.asarray, trace), cfg)
    assert set(got) == set(ref["buf"])
    for k, v in ref["buf"].items():
        assert np.array_equal(got[k].materialize(), v), k
    # the next step in optax equals torch's next SGD step (grads fed through the same rules)
    g_tree = naming.nest(naming.hf_to_tree(naming.Named({k: jobs_array(v) for k, v in ref["grad"].items()}), cfg).params)
    g_tree = jax.tree.map(lambda t: jnp.asarray(t.materialize()), g_tree)
    tx = optax.sgd(LR, momentum=MOMENTUM)
    params = jax.tree.map(np.asarray, r.params)
    updates, _ = tx.update(g_tree, jax.tree.map(np.asarray, r.opt_state), params)
    nxt = naming.tree_to_hf(jax.tree.map(np.asarray, optax.apply_updates(params, updates)), cfg)
    worst = max(float(np.abs(nxt[k].materialize() - v).max()) for k, v in ref["next"].items())
    assert worst <= 1e-7, worst  # fp32, same two ops per element; torch fuses -lr * buf into add_
    moved = max(float(np.abs(ref["next"][k] - ref["param"][k]).max()) for k in ref["next"])
    assert moved > 1e-4  # the step really moved the params: the comparison above can fail
    out = str(root / "out")
    assert main(["export", ckpt, out, "--optimizer", "--quiet"]) == 0
    saved = read_header(f"{out}/optimizer.safetensors").tensors
    assert "step" not in saved and set(saved) == {f"{k}.momentum_buffer" for k in ref["buf"]}
    for k, v in ref["buf"].items():
        assert np.array_equal(saved[f"{k}.momentum_buffer"].materialize(), v), k


def jobs_array(x):
    from hybridckpt.lazy import ArrayTensor

    return ArrayTensor(np.asarray(x))
