"""Per-tensor checksums: independent of sharding, recorded at import, re-checked by `verify CKPT`."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridckpt import checksum, jobs
from hybridckpt.cli import main
from hybridckpt.demo import sample_path
from hybridckpt.mesh import make_mesh
from hybridckpt.store import CheckpointStore, read_trainer_state
from hybridckpt.store.restore import restore


def test_checksum_is_sharding_independent_and_sensitive():
    x = np.random.default_rng(0).standard_normal((8, 6, 4)).astype(np.float32)
    want = checksum.of_array(x)
    mesh = make_mesh(fsdp=2, tp=2, pp=2)
    for spec in (P("pp", "fsdp", "tp"), P(None, "tp"), P()):
        assert checksum.of_array(jax.device_put(x, NamedSharding(mesh, spec))) == want
    flipped = x.copy()
    flipped.view(np.uint32)[3, 2, 1] ^= 1  # one bit
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum.of_array(flipped) != want
    assert checksum.of_array(swapped) != want
    box = ((2, 5), (1, 6), (0, 4))
    parts = checksum.box_part(x.shape, box, x[2:5, 1:6, :])
    rest = checksum.of_array(x) - parts
    assert parts != 0 and rest != 0


@pytest.fixture()
def imported(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    jobs.import_checkpoint(sample_path(), ckpt, mesh="fsdp=2,tp=2,pp=2")
    return ckpt


def test_verify_recorded_checksums_then_detect_a_changed_tensor(imported, capsys):
    sums = read_trainer_state(imported)["checksums"]
    assert "params.layers.q.kernel" in sums and "mu.layers.q.kernel" in sums
    assert main(["verify", imported]) == 0
    # rewrite the step with one element changed but the recorded checksums kept
    _, r = restore(imported, "dp=1")
    state, opt_state = r.trainer_state, r.opt_state
    params = jax.tree.map(np.array, r.params)
    params["layers"]["down"]["kernel"][1, 3, 5] += 1e-6
    bad = imported + "-bad"
    with CheckpointStore(bad) as store:
        store.save(state["step"], params, opt_state, {k: v for k, v in state.items() if k not in ("step", "mesh")})
    capsys.readouterr()
    assert main(["verify", bad]) == 1
    out = capsys.readouterr().out
    assert "BAD params.layers.down.kernel" in out and "35/36 arrays match" in out


def test_flipped_bytes_on_disk_are_reported(imported, capsys):
    """Damage in the array files is either a checksum mismatch or a one-line project error."""
    step_dir = os.path.join(imported, os.listdir(imported)[0] if os.listdir(imported)[0].isdigit() else "0")
    data = []
    for root, _, files in os.walk(os.path.join(step_dir, "params")):
        data += [os.path.join(root, f) for f in files if os.path.getsize(os.path.join(root, f)) > 4096]
    assert data
    target = max(data, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    capsys.readouterr()
    code = main(["verify", imported])
    err = capsys.readouterr()
    assert code in (1, 2), (code, err)
    if code == 2:
        assert err.err.startswith("hybridckpt: error:") and err.err.count("\n") == 1
    else:
        assert "BAD params." in err.out
