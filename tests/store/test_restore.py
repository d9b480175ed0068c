"""`hybridckpt.restore` (jobs.restore): one call puts a checkpoint on any mesh, config from the checkpoint."""

import jax
import numpy as np
import pytest
from meshes import cases, fit, size

from hybridckpt import jobs, naming
from hybridckpt.demo import sample_path
from hybridckpt.errors import CheckpointError
from hybridckpt.jobs.restore import restore


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("restore") / "ckpt")
    jobs.import_checkpoint(sample_path(), d, mesh=fit("fsdp=2,tp=2,pp=2"))
    return d


@pytest.mark.parametrize("mesh", cases(["dp=1", "tp=4,pp=2", "dp=2,fsdp=4"]))
def test_restore_onto_mesh_equals_the_sample(ckpt, mesh):
    cfg, r = restore(ckpt, mesh)
    src = jobs.open_checkpoint(sample_path()).named
    assert r.params["layers"]["q"]["kernel"].sharding.mesh.devices.size == size(mesh)
    back = naming.tree_to_hf(jax.tree.map(np.asarray, r.params), cfg)
    mu = naming.tree_to_hf(jax.tree.map(np.asarray, r.opt_state[0].mu), cfg)
    for k, t in src.params.items():
        np.testing.assert_array_equal(back[k].materialize(), t.materialize())
        np.testing.assert_array_equal(mu[k].materialize(), src.slots["exp_avg"][k].materialize())
    assert int(r.opt_state[0].count) == src.step == 12


def test_params_only_and_bad_step(ckpt):
    _, r = restore(ckpt, fit("tp=2"), optimizer=False)
    assert r.opt_state is None
    with pytest.raises(CheckpointError, match="7"):
        restore(ckpt, "dp=1", step=7)
