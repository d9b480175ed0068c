"""`export --to megatron --optimizer` against the torch_dist checkpoint Megatron-LM wrote itself.

The real `fully_reshardable` save of the dense run (tp2 x pp2 x dp2, megatron-core 0.19.2) is
imported onto a mesh of the devices present and exported back for tp2 x pp2: every key of
Megatron's own save is there (its RNG and rerun-state-machine objects aside: the export writes
`no_save_rng`), under the same stacked names, each tensor with the same dtype, the same global
shape and the same chunks (offsets and sizes: the tp x pp ranks' pieces), every value bitwise
Megatron's on the model's rows (the padded vocabulary rows, Megatron-internal and not in the HF
model, zero); the common state (optimizer param groups, LR schedule, content metadata,
iteration) equal to Megatron's, the `args` fields written equal to the run's; torch's own
`dcp.load` fills the real save's state dict from ours. That Megatron-LM's `load_checkpoint`
loads ours at tp1 pp1 and takes the run's optimizer step was run in the side venv by
generators/_megatron_core_check_export.py; its recorded result (export_checks/) is checked here.
"""

from __future__ import annotations

import json
import os
import warnings

import export_digest
import jax
import numpy as np
import pytest
from cases import ckpt

from hybridckpt import jobs
from hybridckpt.containers.dcp_metadata import read_metadata
from hybridckpt.errors import ConfigError
from hybridckpt.formats.dcp.storage import entry_tensor, load_item

CASE = "megatron_core_dense_fully_reshardable"
ITER = "iter_0000003"
VOCAB = 60  # the run's --vocab-size (padded to 64 in Megatron's tensors)
NOT_WRITTEN = ("rng_state/", "rerun_state_machine_state/")  # the run's own, not the model's
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _mesh() -> str:
    n = jax.device_count()
    return f"fsdp={n // 2},tp=2" if n >= 4 else f"fsdp={n}"


@pytest.fixture(scope="module")
def orbax(tmp_path_factory):
    d = tmp_path_factory.mktemp("megatron_export")
    jobs.import_checkpoint(ckpt(CASE), str(d / "orbax"), mesh=_mesh())
    return d


@pytest.fixture(scope="module")
def exported(orbax):
    s = jobs.export_checkpoint(str(orbax / "orbax"), str(orbax / "ours"), to="megatron", optimizer=True,
                               options={"tp": 2, "pp": 2})  # fmt: skip
    assert s.files == (
        *(f"{ITER}/__{r}_0.distcp" for r in range(4)),
        f"{ITER}/.metadata",
        f"{ITER}/metadata.json",
        "latest_checkpointed_iteration.txt",
    )
    return str(orbax / "ours")


def _chunks(e) -> list:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in e.chunks)


def test_every_key_chunk_and_value_is_megatrons_own(exported):
    real = read_metadata(ckpt(CASE, ITER))
    mine = read_metadata(os.path.join(exported, ITER))
    real_keys = {k for k in [*real.tensors, *real.bytes_items] if not k.startswith(NOT_WRITTEN)}
    assert set(mine.tensors) == set(real.tensors)
    assert set(mine.bytes_items) == real_keys - set(real.tensors)
    assert sum(k.startswith("optimizer.state.") for k in mine.tensors) == 3 * sum(
        not k.startswith("optimizer.") for k in mine.tensors
    )
    for k, e in mine.tensors.items():
        r = real.tensors[k]
        assert (e.dtype, tuple(e.shape), _chunks(e)) == (r.dtype, tuple(r.shape), _chunks(r)), k
        a, b = entry_tensor(r).materialize(), entry_tensor(e).materialize()
        if k.endswith(VOCAB_KEYS):
            assert a.shape[0] == 64 and not b[VOCAB:].any(), k
            a, b = a[:VOCAB], b[:VOCAB]
        assert np.array_equal(a, b), k
    for k in mine.bytes_items:
        if not k.startswith("common_state"):
            assert load_item(mine, k) == load_item(real, k), k  # the linears' extra state: [None]
    for name in ("metadata.json",):
        with open(ckpt(CASE, ITER, name), "rb") as f, open(os.path.join(exported, ITER, name), "rb") as g:
            assert json.loads(f.read()) == json.loads(g.read())
    with open(ckpt(CASE, "latest_checkpointed_iteration.txt")) as f:
        with open(os.path.join(exported, "latest_checkpointed_iteration.txt")) as g:
            assert f.read() == g.read() == "3"


def test_common_state_is_megatrons(exported):
    real = read_metadata(ckpt(CASE, ITER))
    mine = read_metadata(os.path.join(exported, ITER))
    (a,), (b,) = load_item(real, "common_state/shard_0_1"), load_item(mine, "common_state/shard_0_1")
    assert set(a) - set(b) == {"rerun_state_machine"} and set(b) <= set(a)
    for k in b:
        if k != "args":
            assert type(a[k]) is type(b[k]) and a[k] == b[k], k
    assert b["optimizer"]["optimizer"]["param_groups"][1]["wd_mult"] == 0.0  # the norms' group
    ours = vars(b["args"])
    differ = {k for k, v in ours.items() if getattr(a["args"], k, None) != v}
    # ours: no RNG state (the run has one), the layout our chunks follow, a single data rank
    assert differ == {"no_save_rng", "no_save_optim", "world_size", "data_parallel_size"}
    assert ours["no_save_rng"] is True and ours["no_save_optim"] is False


def test_torch_loads_ours_into_the_real_state_dict(exported):
    """torch's own `dcp.load` fills a state dict shaped like Megatron's save from our folder."""
    import torch
    import torch.distributed.checkpoint as dcp

    real = read_metadata(ckpt(CASE, ITER))
    sd = {k: torch.full(tuple(e.shape), 7.0, dtype=getattr(torch, e.dtype.name)) for k, e in real.tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=os.path.join(exported, ITER), no_dist=True)
    for k, e in real.tensors.items():
        want = entry_tensor(e).materialize()
        got = sd[k].numpy()
        if k.endswith(VOCAB_KEYS):
            want, got = want[:VOCAB], got[:VOCAB]
        assert np.array_equal(got, want), k


@pytest.fixture(scope="module")
def today(tmp_path_factory):
    """The exports the records' commands make with today's code (the CLI, in this process)."""
    from hybridckpt.cli import main

    return export_digest.Exports(main, str(tmp_path_factory.mktemp("records")))


def _check_dense_record(exports: export_digest.Exports) -> None:
    ((name, doc),) = export_digest.records("megatron_core_dense_")
    assert doc["ok"] and doc["versions"]["megatron-core"] == "0.19.2"
    assert doc["exported_with"] == "--to megatron --optimizer --tp 2 --pp 2" and doc["loaded_at"] == {"tp": 1, "pp": 1}
    assert doc["export"]["commands"][0][1] == f"tests/real/cases/{CASE}/ckpt"
    lines = doc["lines"]
    assert sum("15/15 bitwise" in x for x in lines) == 3
    assert any(x.startswith("Megatron's optimizer step") and "difference 0 " in x for x in lines)
    assert any(x.startswith("GPTModel's logits") and "difference 0 " in x for x in lines)
    export_digest.assert_current(name, doc, exports)  # the export it loaded is today's


def test_megatron_itself_loaded_ours(today):
    """The recorded run of generators/_megatron_core_check_export.py: Megatron-LM's
    load_checkpoint loaded our tp2 pp2 export at tp1 pp1 and stepped exactly; the record's
    export digest is that of today's export by the same commands (else it is stale)."""
    _check_dense_record(today)


def test_layouts_the_model_cannot_take_are_refused(orbax):
    """pp must divide the layers, tp the query groups (Megatron's own conditions; a row split of
    the fused q/k/v that cut a group would be no run's chunks): one line each, nothing left."""
    out = orbax / "refused"
    with pytest.raises(ConfigError, match="2 layers do not split into 3 equal stages"):
        jobs.export_checkpoint(str(orbax / "orbax"), str(out), to="megatron", options={"pp": 3})
    with pytest.raises(ConfigError, match=r"2 query groups do not split 4 ways"):
        jobs.export_checkpoint(str(orbax / "orbax"), str(out), to="megatron", options={"tp": 4})
    assert not out.exists() and not [p for p in os.listdir(orbax) if p.startswith(".refused")]


def test_one_rank_layout_reads_back(orbax):
    """tp1 pp1: one file, every chunk a whole tensor per layer; our own Megatron reader reads the
    export back to the imported values (bitwise)."""
    from hybridckpt.jobs.open import open_checkpoint

    out = str(orbax / "tp1")
    s = jobs.export_checkpoint(str(orbax / "orbax"), out, to="megatron", optimizer=True)
    assert s.files[0] == f"{ITER}/__0_0.distcp" and s.files[1] == f"{ITER}/.metadata"
    meta = read_metadata(os.path.join(out, ITER))
    layers = meta.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert _chunks(layers) == [((0, 0, 0), (1, 32, 16)), ((1, 0, 0), (1, 32, 16))]  # 2 groups x (2 q, k, v) x 4
    back, src = open_checkpoint(out, "auto"), open_checkpoint(str(orbax / "orbax"), "auto")
    assert back.format.startswith("megatron")
    a, b = src.named.params, back.named.params
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(a[k].materialize(), b[k].materialize()), k


def _check_foreign_records(exports: export_digest.Exports) -> None:
    seen = set()
    for name, doc in export_digest.records("megatron_core_from_torchtitan_"):
        assert doc["ok"] and doc["case"] == "torchtitan_qwen3", name
        assert doc["versions"]["megatron-core"] == "0.19.2" and doc["loaded_at"] == {"tp": 1, "pp": 1}
        assert sum("24/24 bitwise" in x for x in doc["lines"]) == 4, name
        assert any("iteration 3 (torchtitan: 3.0)" in x for x in doc["lines"]), name
        export_digest.assert_current(name, doc, exports)  # the export it loaded is today's
        seen.add(doc["exported_with"])
    assert seen == {"--to megatron --optimizer --pp 2", "--to megatron --optimizer --tp 2"}


def test_megatron_itself_loaded_ours_from_torchtitan(today):
    """The recorded runs of generators/_megatron_core_check_foreign.py: Megatron-LM's
    load_checkpoint loaded our export of torchtitan's own Qwen3 run (tied head, q/k norms;
    exported for tp1 pp2 and tp2 pp1, the latter with 256 vocabulary rows where the loading
    run has 128) at tp1 pp1: params, fp32 masters and moments bitwise torchtitan's, its step,
    and GPTModel's logits equal to torchtitan's forward; each record's export digest is that of
    today's export by the same commands (else it is stale)."""
    _check_foreign_records(today)


@pytest.mark.parametrize("check", [_check_dense_record, _check_foreign_records], ids=["dense", "foreign"])
@pytest.mark.parametrize("mutation", [export_digest.flip_after, export_digest.dropping("--optimizer")],
                         ids=["one-byte", "no-optimizer"])  # fmt: skip
def test_the_records_go_stale_when_the_export_changes(today, check, mutation):
    """A mutation of the export (one byte of one tensor flipped after it is written, or the
    weights alone) fails the record checks above, naming
    the command that writes the record again."""
    from hybridckpt.cli import main

    with pytest.raises(AssertionError, match=r"is stale: .* rerun the check: python tests/real/rerun_export_checks.py "):
        check(today.with_run(mutation(main)))


def test_groups_carry_the_schedule_megatron_pairs_them_by(tmp_path):
    """Megatron's DistributedOptimizer pairs saved and live param groups by (max_lr, min_lr,
    wd_mult, ...): a non-Megatron source's groups carry its peak lr (torchtitan's initial_lr,
    not the warmed-up lr of the save) and Megatron's default min_lr 0.0, and the note says
    which --lr / --min-lr resume them."""
    case = "torchtitan_qwen3"
    from cases import case_dir

    config = os.path.join(case_dir(case), "config.json")
    jobs.import_checkpoint(ckpt(case), str(tmp_path / "orbax"), mesh=_mesh(), config=config)
    s = jobs.export_checkpoint(str(tmp_path / "orbax"), str(tmp_path / "ours"), to="megatron", optimizer=True,
                               options={"pp": 2})  # fmt: skip
    (common,) = load_item(read_metadata(str(tmp_path / "ours" / ITER)), "common_state/shard_0_1")
    groups = common["optimizer"]["optimizer"]["param_groups"]
    assert [(g["max_lr"], g["min_lr"], g["wd_mult"]) for g in groups] == [(0.01, 0.0, 1.0), (0.01, 0.0, 0.0)]
    assert groups[0]["lr"] != 0.01  # the save's own (warm-up) lr, kept as the current one
    assert "resume with --lr 0.01 --min-lr 0.0" in " ".join(s.notes)
    assert common["args"].qk_layernorm is True and common["args"].untie_embeddings_and_output_weights is False


def test_the_sources_metadata_is_checked_not_trusted(orbax):
    """Trainer metadata comes from the source's files: a vocabulary multiple that would pad a
    billion zero rows, a batch size that is a bool, a sample count that is a string, a
    tokenizer type that is a number are not taken (Megatron's defaults, said in the notes).
    Through the registry entry (`write_request`) with the export job's request."""
    from hybridckpt import naming
    from hybridckpt.formats.megatron_dist import write as megatron_dist
    from hybridckpt.jobs.open import open_checkpoint
    from hybridckpt.writers import ExportRequest

    opened = open_checkpoint(str(orbax / "orbax"), "auto")
    named = naming.model_hf(opened.named, opened.config)
    bad = {"make_vocab_size_divisible_by": 10**9, "global_batch_size": True,
           "consumed_train_samples": "12; rm -rf /", "tokenizer_type": 5}  # fmt: skip
    out = str(orbax / "untrusted")
    done = megatron_dist.write_request(ExportRequest("megatron", out, named, opened.config, optimizer=True, trainer=bad,
                                                    hyper=opened.hyper, options={"tp": 2}))  # fmt: skip
    assert done.files[-1] == "latest_checkpointed_iteration.txt" and done.tensors == 3 * len(named.params)  # params and two moments
    meta = read_metadata(os.path.join(out, ITER))
    assert meta.tensors["embedding.word_embeddings.weight"].shape == (256, 16)  # 128 x tp 2
    (common,) = load_item(meta, "common_state/shard_0_1")
    args = vars(common["args"])
    assert args["make_vocab_size_divisible_by"] == 128 and args["consumed_train_samples"] == 0
    assert "global_batch_size" not in args and "tokenizer_type" not in args
    assert any("consumed_train_samples written as 0" in n for n in done.notes)
