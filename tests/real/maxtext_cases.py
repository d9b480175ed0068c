"""What the tests of MaxText's weights cases (test_real_maxtext_<family>.py) share: the source
case's config.json (as a dict, or as a file with some keys changed), the params of an Orbax item
MaxText or we wrote, the relative error of two forwards, and the check that our store exported
back to MaxText is MaxText's own save bit for bit."""

from __future__ import annotations

import json
import os

import numpy as np
from cases import case_dir, ckpt

from hybridckpt import jobs
from hybridckpt.containers.orbax.reader import item_arrays
from hybridckpt.formats.maxtext import layout as maxtext


def config_dict(source: str, **over) -> dict:
    """The config.json of case `source`'s checkpoint, with the keys `over` set."""
    with open(os.path.join(case_dir(source), "ckpt", "config.json")) as f:
        return {**json.load(f), **over}


def config_file(tmp_path, source: str, **over) -> str:
    """`config_dict(source, **over)` written as `tmp_path/config.json`; its path."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config_dict(source, **over)))
    return str(path)


def params(item_dir: str) -> dict[str, np.ndarray]:
    """Every `params.*` array of the Orbax item folder `item_dir`, read whole."""
    return {k: v.materialize() for k, v in item_arrays(item_dir).items() if k.startswith(maxtext.PARAMS)}


def rel(a, b) -> float:
    """max |a - b| / max |b|: how far a forward `a` is from the reference `b`."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def assert_bitwise(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    """The same names, and every array of `theirs` in `ours` with its dtype and bits."""
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and np.array_equal(ours[k], v), k


def exported_back(tmp_path, case: str, config: str, mesh: str | None = None):
    """MaxText's save of `case` imported (with `config`) onto `mesh` (fsdp=2 where two devices
    are) and exported to MaxText again: its params bit for bit. Returns the store's path."""
    import jax

    store, back = tmp_path / "store", tmp_path / "back"
    mesh = mesh or ("fsdp=2" if jax.device_count() >= 2 else "dp=1")
    jobs.import_checkpoint(ckpt(case), store, mesh=mesh, config=config)
    jobs.export_checkpoint(store, back, to="maxtext")
    assert_bitwise(params(str(back / "0" / maxtext.ITEM)), params(ckpt(case, "0", maxtext.ITEM)))
    return store
