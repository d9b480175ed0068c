"""`export --to torchtitan --optimizer` against the checkpoints torchtitan 0.3 wrote itself.

A real torchtitan case is imported onto a mesh of the devices present and exported back: the
step folder holds every key torchtitan's own save holds (its dataloader state aside, which the
export leaves to the new job), every tensor bitwise the same (Llama's wq/wk back in Meta's RoPE
row order by the inverted rules, the q/k/v moments fused per kv group, a tied head under both
names), every byte item (param-group values, lr_scheduler, train_state) equal with its type,
the same planner key paths; and torch's own `dcp.load` fills the state dict of the real save
from ours. That torchtitan's CheckpointManager resumes ours on 1 and 4 ranks (bitwise, and
its next step equal to the run's) was run in its side venv by
generators/_torchtitan_check_export.py; its recorded results (export_checks/) are checked here.
"""

from __future__ import annotations

import os
import warnings

import export_digest
import jax
import numpy as np
import pytest
from cases import case_dir, ckpt

from hybridckpt import jobs
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.formats.dcp.storage import entry_tensor, load_item

CASES = ["torchtitan_llama3", "torchtitan_qwen3"]


def _mesh() -> str:
    n = jax.device_count()
    return f"fsdp={n // 2},tp=2" if n >= 4 else f"fsdp={n}"


@pytest.fixture(scope="module", params=CASES)
def exported(request, tmp_path_factory):
    case = request.param
    d = tmp_path_factory.mktemp(case)
    config = os.path.join(case_dir(case), "config.json")
    jobs.import_checkpoint(ckpt(case), str(d / "orbax"), mesh=_mesh(), config=config)
    s = jobs.export_checkpoint(str(d / "orbax"), str(d / "ours"), to="torchtitan", optimizer=True,
                               options={"files": 2})  # fmt: skip
    assert s.files == ("step-3/__0_0.distcp", "step-3/__1_0.distcp", "step-3/.metadata")
    return case, str(d / "ours" / "step-3")


def test_every_key_and_value_is_torchtitans_own(exported):
    case, ours = exported
    real = read_metadata(ckpt(case, "step-3"))
    mine = read_metadata(ours)
    real_keys = set(real.tensors) | set(real.bytes_items)
    mine_keys = set(mine.tensors) | set(mine.bytes_items)
    assert sorted(real_keys - mine_keys) == [
        "dataloader.dp_rank_0",
        "dataloader.dp_rank_1",
        "dataloader.world_size",
    ]
    assert mine_keys <= real_keys
    fused = [k for k in mine.tensors if ".qkv_linear.wqkv." in k]
    assert fused and all(k.startswith("optimizer.state.") for k in fused)  # moments by parameter
    for k, e in mine.tensors.items():
        a, b = entry_tensor(real.tensors[k]).materialize(), entry_tensor(e).materialize()
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    for k in mine.bytes_items:
        a, b = load_item(real, k), load_item(mine, k)
        assert type(a) is type(b) and a == b, k
    assert {k: mine.planner_data[k] for k in mine_keys} == {
        k: real.planner_data[k] for k in mine_keys
    }


def test_torch_loads_ours_into_the_real_state_dict(exported):
    """torch's own `dcp.load` fills a state dict shaped like the real save's from our folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    case, ours = exported
    real = read_metadata(ckpt(case, "step-3"))
    sd: dict = {}
    for k, e in real.tensors.items():
        sd[k] = torch.zeros(e.shape, dtype=getattr(torch, e.dtype.name))
    for k in real.bytes_items:
        if not k.startswith("dataloader."):
            sd[k] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=ours, no_dist=True)
    for k, e in real.tensors.items():
        assert np.array_equal(sd[k].numpy(), entry_tensor(e).materialize()), k
    assert sd["train_state.step"] == 3 and sd["lr_scheduler.last_epoch"] == 3


@pytest.fixture(scope="module")
def today(tmp_path_factory):
    """The exports the records' commands make with today's code (the CLI, in this process)."""
    from hybridckpt.cli import main

    return export_digest.Exports(main, str(tmp_path_factory.mktemp("records")))


def _check_records(exports: export_digest.Exports) -> None:
    seen = set()
    for name, doc in export_digest.records("torchtitan_"):
        assert doc["ok"] and doc["versions"]["torchtitan"] == "0.3.0", name
        assert doc["world"] != 2 and any("max relative difference 0 " in x for x in doc["lines"]), (
            name
        )
        export_digest.assert_current(name, doc, exports)  # the export it loaded is today's
        seen.add((doc["case"], doc["world"]))
    assert {("torchtitan_llama3", 1), ("torchtitan_llama3", 4), ("torchtitan_qwen3", 1)} <= seen


def test_torchtitan_itself_resumed_ours(today):
    """The recorded runs of generators/_torchtitan_check_export.py: torchtitan's CheckpointManager
    resumed our export on another number of ranks than the run's 2, exactly; each record's
    export digest is that of today's export by the same commands (else it is stale)."""
    _check_records(today)


@pytest.mark.parametrize("mutation", [export_digest.flip_after, export_digest.dropping("--optimizer")],
                         ids=["one-byte", "no-optimizer"])  # fmt: skip
def test_the_records_go_stale_when_the_export_changes(today, mutation):
    """A mutation of the export (one byte of one tensor flipped after it is written, or the
    weights alone) fails the record check above, naming the command that writes the record again."""
    from hybridckpt.cli import main

    with pytest.raises(AssertionError, match=r"is stale: .* rerun the check: python tests/real/rerun_export_checks.py "):
        _check_records(today.with_run(mutation(main)))
