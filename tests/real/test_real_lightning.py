"""Lightning's own checkpoints (`generators/index_optim.py`, Lightning 2.6.6, issue 40) read by the
`lightning` format, against the runtime's references.

- `lightning_ckpt_index`: the `.ckpt` FILE (`state_dict` under the LightningModule's attribute
  `model.`, `optimizer_states[0]` keyed by parameter index, one group). The weights come out
  under HF names bit for bit; the optimizer is handed over as `index_optimizer` with every index's
  moments the runtime's for the name the manifest gives that index. Naming it is `jobs.open`'s
  (`optim.param_order`); `test_file_import_carries_the_moments` checks the whole import (moments
  bitwise, one optax step equal to Lightning's fourth) and passes once that naming is there.
- `lightning_fsdp_sharded`: the FSDPStrategy sharded `.ckpt/` FOLDER (DCP keyed by name, two
  groups by the Trainer's decay rule, `meta.pt`): imported on mesh A, restored on mesh B,
  exported: params and moments bitwise, step 3, the no-decay group as the weight decay mask, and
  one optax step from the imported state, with the gradient of the fourth step recomputed in JAX
  from the run's own tokens (the case records no gradient: FSDP's are sharded flat), lands on
  the params Lightning's fourth step gave.
"""

from __future__ import annotations

import os

import cases
import jax
import numpy as np
import pytest
from meshes import fit_pair

from hybridckpt import jobs, naming
from hybridckpt.formats import registry
from hybridckpt.formats.registry import detect, open_source
from hybridckpt.store.manager import CheckpointStore

FILE, SHARDED = "lightning_ckpt_index", "lightning_fsdp_sharded"


def _src(case: str) -> str:
    return cases.ckpt(case, "step=3.ckpt")


def _refs(case: str, kind: str) -> dict[str, np.ndarray]:
    ref = cases.reference(case)
    return {k[len(kind) + 1:]: v for k, v in ref.items() if k.startswith(kind + "/")}


def meshes() -> tuple[str, str]:
    """(import mesh, restore mesh), fitted (`meshes.fit_pair`): a reshard down to 2 devices; on 1
    both are dp=1 (the same path, the layout unchanged)."""
    return fit_pair("fsdp=2,tp=2,pp=2", "dp=4,tp=2")


def _bitwise(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:5])
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.float32 and g.shape == w.shape, (what, k, g.dtype, g.shape)
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (what, k)


@pytest.mark.parametrize("case", [FILE, SHARDED])
def test_detected_as_lightning_file_folder_and_output_folder(case):
    assert detect(_src(case)) == "lightning"
    assert detect(cases.ckpt(case)) == "lightning"  # the run's checkpoints folder


@pytest.mark.parametrize("case", [FILE, SHARDED])
def test_weights_bitwise_under_hf_names(case):
    src = open_source(_src(case))
    assert src.format == "lightning" and src.config is not None and src.step == 3
    assert src.trainer["attribute_prefix"] == "model."
    assert src.trainer["global_step"] == 3 and src.trainer["epoch"] == 0
    assert src.trainer["lightning_version"] == cases.manifest(case)["versions"]["lightning"]
    (sched,) = src.trainer["lr_schedulers"]
    assert sched["last_epoch"] == 3 and sched["_last_lr"][0] == cases.manifest(case)["hyper"][0]["lr"]
    assert any("attribute prefix 'model.'" in n and "llama" in n for n in src.notes)
    _bitwise({k: t.materialize() for k, t in src.tensors.items()}, _refs(case, "param"), "params")


def test_file_hands_over_the_index_keyed_optimizer():
    """Index i holds the moments of the i-th name of the manifest's group (Lightning's
    `AdamW(self.parameters())`: `named_parameters()` order); nothing is named by the reader (the
    registry's `names` hook names it: `open_source`)."""
    src = registry.reading("lightning").call("open", _src(FILE))
    assert src.optimizer is None
    assert open_source(_src(FILE)).optimizer is not None
    opt = src.index_optimizer
    assert opt.tool == "lightning" and opt.path == _src(FILE)
    (want,) = cases.manifest(FILE)["hyper"]
    (group,) = opt.groups
    assert group["params"] == list(range(len(want["names"])))
    assert group["lr"] == want["lr"] and group["weight_decay"] == want["weight_decay"]
    assert tuple(group["betas"]) == tuple(want["betas"]) and group["eps"] == want["eps"]
    ref = cases.reference(FILE)
    for i, name in enumerate(want["names"]):
        assert opt.steps[i] == 3.0
        for slot in ("exp_avg", "exp_avg_sq"):
            got = opt.state[i][slot].materialize()
            assert got.shape == ref[f"{slot}/{name}"].shape, (i, name)
            assert np.array_equal(got.view(np.uint32), ref[f"{slot}/{name}"].view(np.uint32)), (i, name, slot)


@pytest.mark.parametrize("case", [FILE, SHARDED])
def test_logits_equal_transformers(case):
    ref = cases.reference(case)
    got = jobs.logits(_src(case), ref["tokens"], mesh=meshes()[1])
    np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=2e-5)


def test_step_honoured(tmp_path):
    """A folder of several `.ckpt`: the latest by default, `step=` another, a step not there one
    error naming those that are."""
    import shutil

    import torch

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    shutil.copy(_src(FILE), folder / "epoch=0-step=3.ckpt")
    obj = torch.load(_src(FILE), weights_only=False)
    obj["global_step"] = 5
    torch.save(obj, folder / "epoch=0-step=5.ckpt")
    assert open_source(str(folder)).step == 5
    three = open_source(str(folder), step=3)
    assert three.step == 3 and any("read step 3 (asked for), epoch=0-step=3.ckpt," in n for n in three.notes)
    from hybridckpt.errors import FormatError

    with pytest.raises(FormatError, match=r"no step 4.*steps 3, 5"):
        open_source(str(folder), step=4)


# -- the sharded folder: import, restore, export, one optax step --------------------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from e2e import roundtrip

    work = tmp_path_factory.mktemp("lightning_sharded")
    a, b = meshes()
    return str(work), roundtrip(_src(SHARDED), str(work), mesh_a=a, mesh_b=b)


def test_sharded_params_and_moments_bitwise(imported):
    _, (params, mu, nu, step) = imported
    _bitwise(params, _refs(SHARDED, "param"), "params")
    _bitwise(mu, _refs(SHARDED, "exp_avg"), "exp_avg")
    _bitwise(nu, _refs(SHARDED, "exp_avg_sq"), "exp_avg_sq")
    assert [step] == cases.manifest(SHARDED)["optimizer_step"] == [3]


def test_sharded_hyper_and_decay_mask(imported):
    work, _ = imported
    g0, g1 = cases.manifest(SHARDED)["hyper"]
    with CheckpointStore(os.path.join(work, "orbax")) as store:
        state = store.trainer_state(3)
    hyper = state["optimizer_hyper"]
    assert (hyper["lr"], hyper["eps"], hyper["betas"], hyper["weight_decay"]) == (
        g0["lr"], g0["eps"], g0["betas"], g0["weight_decay"])
    cfg = jobs.open_checkpoint(os.path.join(work, "orbax")).config
    from hybridckpt import models

    shapes = naming.flatten(models.param_shape_tree(cfg))
    undecayed = {n for leaf, d in state["weight_decay_mask"].items() if not d
                 for n in naming.tree_to_hf({leaf: np.zeros(shapes[leaf])}, cfg)}
    assert undecayed == set(g1["names"])


def _fourth_step_grads() -> dict[str, np.ndarray]:
    """The gradient Lightning's fourth step consumed, recomputed by transformers itself (the case
    records none: FSDP's are sharded flat): each of the 2 ranks' loss on its 2 rows of step index 3
    with the step-3 params, backward, averaged over the ranks as FSDP's reduce-scatter does."""
    import sys

    import torch
    import transformers

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "generators"))
    from hf_trainer import _data

    m = cases.manifest(SHARDED)
    cfg = transformers.LlamaConfig(**m["llama"])
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in _refs(SHARDED, "param").items()}, strict=True)
    ids = torch.stack([r["input_ids"] for r in _data()])
    world, step = m["world"], 3
    grads: dict[str, np.ndarray] = {}
    for rank in range(world):
        model.zero_grad()
        rows = ids[(step * world + rank) * 2:(step * world + rank) * 2 + 2]
        model(input_ids=rows, labels=rows).loss.backward()
        for n, p in model.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad.numpy().copy()
    return {n: (g / world).astype(np.float32) for n, g in grads.items()}


def test_sharded_next_step_equals_lightnings_fourth(imported):
    import optax

    from hybridckpt import lazy
    from hybridckpt.jobs.restore import restore

    work, (params, _, _, _) = imported
    cfg, r = restore(os.path.join(work, "orbax"), meshes()[1], optimizer="from-checkpoint")
    host = jax.tree.map(np.asarray, (r.params, r.opt_state))
    tree = naming.hf_to_tree(naming.Named({k: lazy.ArrayTensor(v) for k, v in _fourth_step_grads().items()}), cfg)
    grads = jax.tree.map(lambda p, g: np.asarray(g.materialize(), p.dtype), host[0], naming.nest(tree.params))

    @jax.jit
    def step(params, opt_state, grads):
        updates, _ = r.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates)

    after = naming.tree_to_hf(jax.tree.map(np.asarray, step(*host, grads)), cfg)
    want = _refs(SHARDED, "param_next")
    assert sorted(after) == sorted(want)
    for k, w in want.items():
        got = after[k].materialize()
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6, err_msg=k)
        assert not np.allclose(w, params[k], rtol=1e-5, atol=1e-6), k  # every param moved


# -- the file: the whole import (moments named by jobs.open from named_parameters() order) -------


def test_file_import_carries_the_moments(tmp_path):
    """Passes once `jobs.open` names `index_optimizer` (issue 40's `--param-order` work): until
    then the import carries the weights alone and `roundtrip` says so first."""
    from e2e import optax_step, roundtrip

    from hybridckpt import lazy
    from hybridckpt.jobs.restore import restore

    a, b = meshes()
    params, mu, nu, step = roundtrip(_src(FILE), str(tmp_path), mesh_a=a, mesh_b=b)
    _bitwise(params, _refs(FILE, "param"), "params")
    _bitwise(mu, _refs(FILE, "exp_avg"), "exp_avg")
    _bitwise(nu, _refs(FILE, "exp_avg_sq"), "exp_avg_sq")
    assert step == 3
    cfg, r = restore(os.path.join(tmp_path, "orbax"), meshes()[1], optimizer="from-checkpoint")
    grads = naming.hf_to_tree(naming.Named({k: lazy.ArrayTensor(v) for k, v in _refs(FILE, "grad").items()}), cfg)
    gtree = jax.tree.map(lambda p, g: jax.numpy.asarray(g.materialize(), p.dtype), r.params, naming.nest(grads.params))
    after = naming.tree_to_hf(jax.tree.map(np.asarray, optax_step(r.tx, gtree, r.opt_state, r.params)), cfg)
    for k, w in _refs(FILE, "param_next").items():
        np.testing.assert_allclose(after[k].materialize(), w, rtol=1e-5, atol=1e-7, err_msg=k)
