"""Every option of every `hybridckpt` command against each kind of input it takes: honoured,
refused (one line of `hybridckpt.errors`, exit 2, nothing written), or not applicable by
construction. The brief's rule: a flag a command accepts is honoured or refused, never ignored
(ninth stop, flags9; docs/cli.md, "Ninth stop: flags9").

`ROWS` is the audit's table: (command, flag, input kind, verdict, evidence). Evidence is
- `case:ID`: a case of `CASES`, run here on the built-in sample (an HF folder written by
  transformers' `save_pretrained`) or on our Orbax store the real tool imports from it;
- `tests/PATH::NEEDLE`: a test module of the suite that shows it (the file must exist and hold
  NEEDLE, the flag by default): the expensive kinds (a bucket, a folder of several steps, an
  index-keyed optimizer state, each `--to`) are shown there, not again here;
- for "n/a", why the flag cannot act on that input, by construction.

A new option without a row fails `test_every_option_of_every_command_has_a_row`, a row of an
option that is gone fails it too; each refused case checks the one line, exit 2 and that
nothing was written.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
from dataclasses import dataclass

import pytest

from hybridckpt.cli import main
from hybridckpt.cli.parser import build_parser
from hybridckpt.demo import sample_path
from hybridckpt.io.byte_source import close_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HF = "hf folder (the sample)"
OURS = "our Orbax store"
STEPS = "a folder of several steps"
BUCKET = "a bucket URL (s3://, gs://)"
INDEX = "an optimizer state keyed by index"
PLAN = "--plan"
ANY = "any source"

# (command, flag, input kind, verdict, evidence)
ROWS: tuple[tuple[str, str, str, str, str], ...] = (
    # -- inspect -------------------------------------------------------------------------------------
    ("inspect", "--json", ANY, "honoured", "tests/jobs/test_smaller_ones.py"),
    ("inspect", "--json", PLAN, "honoured", "tests/remote/test_remote_commands.py::--json"),
    ("inspect", "--plan", "with --mesh", "honoured", "tests/jobs/test_plan_report.py"),
    ("inspect", "--plan", "without --mesh", "refused", "case:inspect-plan-without-mesh"),
    ("inspect", "--mesh", "without --plan", "refused", "case:inspect-mesh-without-plan"),
    ("inspect", "--processes", PLAN, "honoured", "tests/jobs/test_plan_report.py"),
    ("inspect", "--processes", "without --plan", "refused", "case:inspect-processes-without-plan"),
    ("inspect", "--process", PLAN, "honoured", "tests/remote/test_multihost_bucket.py"),
    ("inspect", "--process", "without --plan", "refused", "case:inspect-process-without-plan"),
    ("inspect", "--format", ANY, "honoured", "tests/formats/test_registry.py"),
    ("inspect", "--step", STEPS, "honoured", "tests/jobs/test_steps.py"),
    ("inspect", "--step", OURS, "honoured", "tests/jobs/test_steps.py"),
    ("inspect", "--step", "a source of one step", "refused", "case:inspect-step-of-one-step"),
    ("inspect", "--config", ANY, "honoured", "tests/jobs/test_steps.py"),
    ("inspect", "--param-order", INDEX, "honoured", "tests/real/test_real_index_names.py"),
    ("inspect", "--param-order", "a reader that names its optimizer", "refused", "case:inspect-param-order-hf"),
    ("inspect", "--debug", ANY, "honoured", "tests/jobs/test_front_door.py"),
    # -- import --------------------------------------------------------------------------------------
    ("import", "--mesh", ANY, "honoured", "tests/jobs/test_front_door.py"),
    ("import", "--mesh", PLAN, "honoured", "tests/jobs/test_plan_report.py"),
    ("import", "--params-only", "with optimizer state", "honoured", "tests/jobs/test_newcomer.py"),
    ("import", "--params-only", "without optimizer state", "n/a",
     "n/a: nothing to leave out; the summary says 'without optimizer state' either way"),
    ("import", "--params-only", PLAN, "honoured", "case:import-plan-params-only"),
    ("import", "--dtype", ANY, "honoured", "tests/jobs/test_stored_dtypes.py"),
    ("import", "--dtype", PLAN, "honoured", "case:import-plan-dtype"),
    ("import", "--rules", ANY, "honoured", "tests/jobs/test_front_door.py"),
    ("import", "--strict-sharding", ANY, "honoured", "tests/test_head_sharding.py"),
    ("import", "--strict-sharding", "with --replicate-indivisible", "refused", "case:import-strict-and-replicate"),
    ("import", "--replicate-indivisible", ANY, "n/a", "n/a: the default (hidden, kept for old scripts)"),
    ("import", "--replicate-indivisible", "with --strict-sharding", "refused", "case:import-strict-and-replicate"),
    ("import", "--overwrite", ANY, "honoured", "tests/jobs/test_destinations.py"),
    ("import", "--overwrite", BUCKET, "honoured", "tests/remote/test_store_s3.py"),
    ("import", "--overwrite", PLAN, "refused", "case:import-plan-overwrite"),
    ("import", "--compression", ANY, "honoured", "tests/store/test_codec.py::compression"),
    ("import", "--compression", BUCKET, "honoured", "tests/remote/test_store_bucket_native.py"),
    ("import", "--compression", PLAN, "refused", "case:import-plan-compression"),
    ("import", "--buffered-writes", "raw chunks", "honoured", "tests/store/test_chunk_files.py"),
    ("import", "--buffered-writes", "with --compression zstd", "refused", "case:import-buffered-zstd"),
    ("import", "--buffered-writes", PLAN, "refused", "case:import-plan-buffered"),
    ("import", "--no-verify-reads", OURS, "honoured", "tests/store/test_untrusted_sources.py"),
    ("import", "--no-verify-reads", "a source not ours", "refused", "case:import-no-verify-hf"),
    ("import", "--no-verify-reads", PLAN, "refused", "case:import-plan-no-verify"),
    ("import", "--plan", ANY, "honoured", "tests/jobs/test_plan_report.py"),
    ("import", "--plan", BUCKET, "honoured", "tests/remote/test_remote_commands.py"),
    ("import", "--json", ANY, "honoured", "tests/jobs/test_profile.py"),
    ("import", "--json", PLAN, "honoured", "tests/jobs/test_plan_report.py::--json"),
    ("import", "--profile", ANY, "honoured", "tests/jobs/test_profile.py"),
    ("import", "--profile", PLAN, "refused", "tests/jobs/test_profile.py::--plan"),
    ("import", "--processes", PLAN, "honoured", "tests/jobs/test_plan_report.py"),
    ("import", "--processes", "without --plan", "refused", "case:import-processes-without-plan"),
    ("import", "--process", PLAN, "honoured", "tests/remote/test_multihost_bucket.py"),
    ("import", "--process", "without --plan", "refused", "case:import-process-without-plan"),
    ("import", "--format", ANY, "honoured", "tests/formats/test_registry.py"),
    ("import", "--step", STEPS, "honoured", "tests/jobs/test_steps.py"),
    ("import", "--step", "a source of one step", "refused", "case:import-step-of-one-step"),
    ("import", "--io-threads", ANY, "honoured", "tests/jobs/test_newcomer.py"),
    ("import", "--io-threads", PLAN, "refused", "case:import-plan-io-threads"),
    ("import", "--config", ANY, "honoured", "tests/jobs/test_import_loads.py"),
    ("import", "--config", PLAN, "honoured", "tests/jobs/test_plan_report.py"),
    ("import", "--param-order", INDEX, "honoured", "tests/real/test_real_index_names.py::param_order="),
    ("import", "--param-order", "a reader that names its optimizer", "refused", "case:import-param-order-hf"),
    ("import", "--quiet", ANY, "honoured", "tests/jobs/test_front_door.py"),
    ("import", "--quiet", PLAN, "n/a", "n/a: --plan draws no progress bar"),
    ("import", "--debug", ANY, "honoured", "tests/jobs/test_front_door.py"),
    # -- export --------------------------------------------------------------------------------------
    ("export", "--optimizer", "with optimizer state", "honoured", "tests/jobs/test_export_dcp.py"),
    ("export", "--optimizer", "without optimizer state", "honoured",
     "tests/jobs/test_smaller_ones.py::holds no optimizer state (weights only)"),
    ("export", "--optimizer-layout", "--to hf --optimizer", "honoured", "tests/real/test_real_export_trainer.py"),
    ("export", "--optimizer-layout", "--to hf without --optimizer", "refused", "case:export-layout-without-optimizer"),
    ("export", "--optimizer-layout", "any other --to", "refused", "case:export-layout-to-dcp"),
    ("export", "--dtype", ANY, "honoured", "tests/jobs/test_stored_dtypes.py"),
    ("export", "--dtype", "--to paddle*", "honoured", "tests/formats/test_paddleformers.py"),
    ("export", "--rules", ANY, "honoured", "tests/formats/test_paddle_aoa.py"),
    ("export", "--max-shard-gb", "--to hf", "honoured", "case:export-max-shard-hf"),
    ("export", "--max-shard-gb", "--to dcp, torchtitan, megatron", "honoured", "tests/jobs/test_export_dcp.py::max-shard-gb"),
    ("export", "--max-shard-gb", "--to paddle*", "honoured", "case:export-max-shard-paddle"),
    ("export", "--max-shard-gb", "--to maxtext", "refused", "case:export-max-shard-maxtext"),
    ("export", "--no-verify-reads", OURS, "honoured", "tests/test_hostile.py::--no-verify-reads"),
    ("export", "--no-verify-reads", "a source not ours", "refused", "case:export-no-verify-hf"),
    ("export", "--to", ANY, "honoured", "tests/jobs/test_export_names.py"),
    ("export", "--writers", "--to dcp, torchtitan", "honoured", "tests/jobs/test_export_dcp.py"),
    ("export", "--writers", "any other --to", "refused", "tests/formats/test_registry.py"),
    ("export", "--tp", "--to megatron", "honoured", "tests/jobs/test_export_dcp.py"),
    ("export", "--tp", "any other --to", "refused", "tests/formats/test_registry.py"),
    ("export", "--pp", "--to megatron", "honoured", "tests/formats/test_registry.py"),
    ("export", "--pp", "any other --to", "refused", "tests/formats/test_registry.py"),
    ("export", "--scan-layers", "--to maxtext", "honoured", "tests/real/test_real_maxtext_layout.py::scan"),
    ("export", "--scan-layers", "any other --to", "refused", "tests/formats/test_registry.py"),
    ("export", "--overwrite", ANY, "honoured", "tests/jobs/test_destinations.py"),
    ("export", "--overwrite", BUCKET, "honoured", "tests/remote/test_export_s3.py"),
    ("export", "--buffered-writes", "--to hf", "honoured", "tests/test_hostile.py"),
    ("export", "--buffered-writes", "--to dcp, torchtitan, megatron", "honoured",
     "tests/io/test_sequential_file.py::direct or buffered"),  # (the writer's SequentialFile, direct=direct_io)
    ("export", "--buffered-writes", "--to maxtext", "refused", "case:export-buffered-maxtext"),
    ("export", "--buffered-writes", "--to paddle*", "refused", "case:export-buffered-paddle"),
    ("export", "--json", ANY, "honoured", "tests/jobs/test_profile.py"),
    ("export", "--profile", ANY, "honoured", "tests/jobs/test_profile.py"),
    ("export", "--format", ANY, "honoured", "tests/formats/test_registry.py"),
    ("export", "--step", STEPS, "honoured", "tests/jobs/test_steps.py"),
    ("export", "--step", "a source of one step", "refused", "case:export-step-of-one-step"),
    ("export", "--io-threads", ANY, "honoured", "tests/formats/test_hf.py"),
    ("export", "--config", ANY, "honoured", "tests/jobs/test_steps.py"),
    ("export", "--param-order", INDEX, "honoured", "tests/real/test_real_index_names.py::param_order="),
    ("export", "--param-order", "a reader that names its optimizer", "refused", "case:export-param-order-hf"),
    ("export", "--quiet", ANY, "honoured", "tests/jobs/test_front_door.py"),
    ("export", "--debug", ANY, "honoured", "tests/jobs/test_front_door.py"),
    # -- verify --------------------------------------------------------------------------------------
    ("verify", "--atol", "A B", "honoured", "case:verify-atol"),
    ("verify", "--atol", "A alone", "refused", "tests/jobs/test_smaller_ones.py"),
    ("verify", "--params-only", "A B", "honoured", "tests/test_hostile.py"),
    ("verify", "--params-only", "A alone", "refused", "tests/jobs/test_smaller_ones.py"),
    ("verify", "--no-verify-reads", "A B, one of them ours", "honoured", "case:verify-no-verify-one-ours"),
    ("verify", "--no-verify-reads", "A B, neither ours", "refused", "case:verify-no-verify-neither-ours"),
    ("verify", "--no-verify-reads", "A alone", "refused", "tests/jobs/test_smaller_ones.py"),
    ("verify", "--step", "A B", "honoured", "tests/jobs/test_steps.py"),
    ("verify", "--step", "A alone", "honoured", "tests/jobs/test_steps.py::verify"),
    ("verify", "--config", "A B", "honoured", "tests/jobs/test_smaller_ones.py"),
    ("verify", "--config", "A alone", "refused", "tests/jobs/test_smaller_ones.py"),
    ("verify", "--param-order", "A B, one index-keyed", "honoured", "tests/real/test_real_index_names.py::jobs.verify(src, src, param_order"),
    ("verify", "--param-order", "A alone", "refused", "case:verify-param-order-alone"),
    ("verify", "--quiet", "A B", "honoured", "case:verify-quiet"),
    ("verify", "--quiet", "A alone", "n/a", "n/a: prints only the BAD rows and the total already; no progress bar then"),
    ("verify", "--debug", ANY, "honoured", "tests/jobs/test_front_door.py"),
    # -- logits --------------------------------------------------------------------------------------
    ("logits", "--tokens", ANY, "honoured", "tests/jobs/test_smaller_ones.py"),
    ("logits", "--out", ANY, "honoured", "tests/jobs/test_smaller_ones.py"),
    ("logits", "--mesh", ANY, "honoured", "tests/jobs/test_cli_formats.py::--mesh"),
    ("logits", "--compute-dtype", ANY, "honoured", "case:logits-compute-dtype"),
    ("logits", "--no-verify-reads", OURS, "honoured", "case:logits-no-verify-ours"),
    ("logits", "--no-verify-reads", "a source not ours", "refused", "case:logits-no-verify-hf"),
    ("logits", "--format", ANY, "honoured", "tests/formats/test_hf.py::logits"),
    ("logits", "--step", STEPS, "honoured", "tests/jobs/test_steps.py::logits"),
    ("logits", "--config", ANY, "honoured", "tests/jobs/test_steps.py::--config"),
    ("logits", "--param-order", INDEX, "n/a",
     "n/a: names the state the source opens with (the rule's failure names --param-order), read by no forward pass"),
    ("logits", "--param-order", "a reader that names its optimizer", "refused", "case:logits-param-order-hf"),
    ("logits", "--debug", ANY, "honoured", "tests/jobs/test_front_door.py"),
    # -- demo ----------------------------------------------------------------------------------------
    ("demo", "--workdir", "the built-in sample", "honoured", "case:demo-workdir"),
    ("demo", "--keep", "the built-in sample", "honoured", "case:demo-keep"),
    ("demo", "--keep", "with --workdir", "n/a", "n/a: --workdir's folder is always kept, which --keep asks"),
    ("demo", "--debug", "the built-in sample", "honoured", "tests/jobs/test_front_door.py"),
)
VERDICTS = ("honoured", "refused", "n/a")


def _options() -> set[tuple[str, str]]:
    """(command, first option string) of every option of every command (help left out)."""
    out = set()
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= {(name, a.option_strings[0]) for a in sub._actions
                        if a.option_strings and not isinstance(a, argparse._HelpAction)}
    return out


def test_every_option_of_every_command_has_a_row():
    rows = {(c, f) for c, f, *_ in ROWS}
    assert sorted(_options() - rows) == [], "an option without a row in the audit (add its rows)"
    assert sorted(rows - _options()) == [], "a row of an option no command has"


def test_every_row_has_its_evidence():
    for command, flag, kind, verdict, evidence in ROWS:
        where = (command, flag, kind)
        assert verdict in VERDICTS, where
        if evidence.startswith("n/a:"):
            assert len(evidence) > 10, where
            continue
        if evidence.startswith("case:"):
            case = CASES[evidence[5:]]
            assert case.verdict == verdict and flag in case.argv, (where, case)
            continue
        path, _, needle = evidence.partition("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        assert (needle or flag.lstrip("-")) in text, (where, evidence)
    assert len({(c, f, k) for c, f, k, *_ in ROWS}) == len(ROWS), "a row twice"


# -- the cases run here ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """argv (`{hf}`, `{ours}`, `{dst}`, `{order}`, `{damaged}`, `{perturbed}` filled in); refused: the one line
    holds `says`; honoured: `check(out, tmp)` shows the effect."""

    argv: tuple[str, ...]
    verdict: str
    says: str = ""
    check: object = None


def _shards(prefix: str):
    def check(out: str, tmp: str) -> None:
        files = sorted(os.listdir(os.path.join(tmp, "dst")))
        return sum(f.startswith(prefix) and f.endswith(".safetensors") for f in files) > 1
    return check


def _planned(out: str) -> dict:
    import json

    return json.loads(out)


def _matched(out: str) -> bool:
    """`N/N items match`: every item compared equal."""
    done, total = out.strip().splitlines()[-1].split(" items match")[0].split("/")
    return done == total and int(total) > 0


def _not_fp32_logits(tmp: str) -> bool:
    """The bf16 forward pass's logits differ from the fp32 one's (`hybridckpt.logits`)."""
    import numpy as np

    import hybridckpt

    got = np.load(os.path.join(tmp, "dst.npy"))
    want = hybridckpt.logits(sample_path(), [1, 2, 3])
    return got.shape == want.shape and not np.array_equal(got, want) and np.allclose(got, want, atol=0.1)


def _kept(out: str) -> bool:
    """The temporary folder the demo printed is still there (then removed)."""
    line = next(ln for ln in out.splitlines() if ln.startswith("files kept in "))
    folder = line[len("files kept in "):].split(":")[0]
    kept = os.path.isdir(os.path.join(folder, "orbax"))
    shutil.rmtree(folder, ignore_errors=True)
    return kept


def _perturbed(tmp: str) -> str:
    """A copy of the sample with one weight moved by 1e-4 (written by safetensors itself)."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file

    copy = os.path.join(tmp, "perturbed")
    shutil.copytree(sample_path(), copy)
    path = os.path.join(copy, "model.safetensors")
    with safe_open(path, "np") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = (tensors[name] + np.float32(1e-4)).astype(tensors[name].dtype)
    save_file(tensors, path, metadata=meta)
    return copy


PLAN_J = ("import", "{hf}", "{dst}", "--plan", "--json")
CASES: dict[str, Case] = {
    "inspect-plan-without-mesh": Case(("inspect", "{hf}", "--plan"), "refused", "inspect --plan needs --mesh"),
    "inspect-mesh-without-plan": Case(("inspect", "{hf}", "--mesh", "tp=2"), "refused", "--mesh is only for --plan"),
    "inspect-processes-without-plan": Case(("inspect", "{hf}", "--processes", "2"), "refused", "only for --plan"),
    "inspect-process-without-plan": Case(("inspect", "{hf}", "--process", "0"), "refused", "only for --plan"),
    "inspect-step-of-one-step": Case(("inspect", "{hf}", "--step", "3"), "refused", "no step 3"),
    "inspect-param-order-hf": Case(("inspect", "{hf}", "--param-order", "{order}"), "refused", "nothing to order"),
    "import-plan-params-only": Case((*PLAN_J, "--params-only"), "honoured",
                                    check=lambda out, tmp: _planned(out)["tensor_bytes"] == 90752),  # (272,260 with the moments)
    "import-plan-dtype": Case((*PLAN_J, "--dtype", "bfloat16", "--params-only"), "honoured",
                              check=lambda out, tmp: _planned(out)["processes"][0]["bytes_written"] == 90752 // 2),
    "import-strict-and-replicate": Case(("import", "{hf}", "{dst}", "--strict-sharding", "--replicate-indivisible"),
                                        "refused", "--replicate-indivisible: the default"),
    "import-plan-overwrite": Case((*PLAN_J, "--overwrite"), "refused", "--overwrite: not for --plan"),
    "import-plan-compression": Case((*PLAN_J, "--compression", "zstd"), "refused", "--compression: not for --plan"),
    "import-plan-buffered": Case((*PLAN_J, "--buffered-writes"), "refused", "--buffered-writes: not for --plan"),
    "import-plan-no-verify": Case((*PLAN_J, "--no-verify-reads"), "refused", "--no-verify-reads: not for --plan"),
    "import-plan-io-threads": Case((*PLAN_J, "--io-threads", "2"), "refused", "--io-threads: not for --plan"),
    "import-buffered-zstd": Case(("import", "{hf}", "{dst}", "--compression", "zstd", "--buffered-writes"),
                                 "refused", "--buffered-writes: the raw chunk files alone"),
    "import-no-verify-hf": Case(("import", "{hf}", "{dst}", "--no-verify-reads"), "refused",
                                "--no-verify-reads: ", ),
    "import-processes-without-plan": Case(("import", "{hf}", "{dst}", "--processes", "2"), "refused", "only for --plan"),
    "import-process-without-plan": Case(("import", "{hf}", "{dst}", "--process", "0"), "refused", "only for --plan"),
    "import-step-of-one-step": Case(("import", "{hf}", "{dst}", "--step", "3"), "refused", "no step 3"),
    "import-param-order-hf": Case(("import", "{hf}", "{dst}", "--param-order", "{order}"), "refused", "nothing to order"),
    "export-layout-without-optimizer": Case(("export", "{hf}", "{dst}", "--optimizer-layout", "trainer"), "refused",
                                            "--optimizer-layout"),
    "export-layout-to-dcp": Case(("export", "{hf}", "{dst}", "--to", "dcp", "--optimizer-layout", "trainer"),
                                 "refused", "--optimizer-layout: only for --to hf"),
    "export-max-shard-hf": Case(("export", "{hf}", "{dst}", "--max-shard-gb", "0.00003", "--quiet"), "honoured",
                                check=_shards("model-")),
    "export-max-shard-paddle": Case(("export", "{hf}", "{dst}", "--to", "paddleformers-unified", "--max-shard-gb",
                                     "0.00003", "--quiet"), "honoured", check=_shards("model-")),
    "export-max-shard-maxtext": Case(("export", "{hf}", "{dst}", "--to", "maxtext", "--max-shard-gb", "1"), "refused",
                                     "--max-shard-gb: only for --to hf"),
    "export-no-verify-hf": Case(("export", "{hf}", "{dst}", "--no-verify-reads"), "refused", "--no-verify-reads: "),
    "export-buffered-maxtext": Case(("export", "{hf}", "{dst}", "--to", "maxtext", "--buffered-writes"), "refused",
                                    "--buffered-writes: only for --to hf"),
    "export-buffered-paddle": Case(("export", "{hf}", "{dst}", "--to", "paddlenlp-unified", "--buffered-writes"),
                                   "refused", "--buffered-writes: only for --to hf"),
    "export-step-of-one-step": Case(("export", "{hf}", "{dst}", "--step", "3"), "refused", "no step 3"),
    "export-param-order-hf": Case(("export", "{hf}", "{dst}", "--param-order", "{order}"), "refused", "nothing to order"),
    "verify-no-verify-one-ours": Case(("verify", "{damaged}", "{hf}", "--no-verify-reads", "--quiet"), "honoured",
                                      check=lambda out, tmp: "BAD model.layers.0.self_attn.q_proj.weight" in out),
    "verify-no-verify-neither-ours": Case(("verify", "{hf}", "{hf}", "--no-verify-reads"), "refused",
                                          "--no-verify-reads: neither"),
    "verify-param-order-alone": Case(("verify", "{ours}", "--param-order", "{order}"), "refused",
                                     "--param-order: only for comparing two checkpoints"),
    "verify-quiet": Case(("verify", "{ours}", "{hf}", "--quiet"), "honoured",
                         check=lambda out, tmp: not any(line.startswith("ok ") for line in out.splitlines())),
    "verify-atol": Case(("verify", "{hf}", "{perturbed}", "--atol", "1e-3", "--quiet"), "honoured",
                        check=lambda out, tmp: "BAD" not in out and _matched(out)),
    "logits-compute-dtype": Case(("logits", "{hf}", "--tokens", "1,2,3", "--compute-dtype", "bfloat16", "--out",
                                  "{dst}.npy"), "honoured", check=lambda out, tmp: _not_fp32_logits(tmp)),
    "logits-no-verify-ours": Case(("logits", "{damaged}", "--tokens", "1,2", "--no-verify-reads"), "honoured",
                                  check=lambda out, tmp: "argmax per position" in out),
    "demo-workdir": Case(("demo", "--workdir", "{dst}"), "honoured",
                         check=lambda out, tmp: {"orbax", "exported"} <= set(os.listdir(os.path.join(tmp, "dst")))),
    "demo-keep": Case(("demo", "--keep"), "honoured", check=lambda out, tmp: _kept(out)),
    "logits-no-verify-hf": Case(("logits", "{hf}", "--tokens", "1,2", "--no-verify-reads"), "refused",
                                "--no-verify-reads: "),
    "logits-param-order-hf": Case(("logits", "{hf}", "--tokens", "1,2", "--param-order", "{order}"), "refused",
                                  "nothing to order"),
}


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> str:
    """Our Orbax store of the sample, written by the real tool (`hybridckpt import`)."""
    path = str(tmp_path_factory.mktemp("ours") / "ck")
    assert main(["import", sample_path(), path, "--quiet"]) == 0
    close_all()
    return path


def _damage(ours: str, tmp: str) -> str:
    """A copy of `ours` with one byte of the first chunk of the q projection flipped."""
    copy = os.path.join(tmp, "damaged")
    shutil.copytree(ours, copy)
    folder = glob.glob(os.path.join(copy, "*", "params", "layers.q.kernel"))[0]
    chunk = sorted(f for f in glob.glob(os.path.join(folder, "*")) if not f.endswith(".zarray"))[0]
    data = bytearray(open(chunk, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(chunk, "wb").write(bytes(data))
    return copy


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, tmp_path, capsys, request):
    case = CASES[name]
    fill = {"hf": sample_path(), "dst": str(tmp_path / "dst"), "order": str(tmp_path / "order.txt")}
    (tmp_path / "order.txt").write_text("model.embed_tokens.weight\n")
    if any("{perturbed}" in a for a in case.argv):
        fill["perturbed"] = _perturbed(str(tmp_path))
    if any("{ours}" in a or "{damaged}" in a for a in case.argv):
        fill["ours"] = request.getfixturevalue("ours")
        if any("{damaged}" in a for a in case.argv):
            fill["damaged"] = _damage(fill["ours"], str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    capsys.readouterr()
    code = main([a.format(**fill) for a in case.argv])
    close_all()
    out, err = capsys.readouterr()
    if case.verdict == "refused":
        assert code == 2, (code, out, err)
        assert err.count("\n") == 1 and err.startswith("hybridckpt: error: "), err
        assert case.says in err, (case.says, err)
        assert sorted(os.listdir(tmp_path)) == before, "a refused command wrote something"
    else:
        assert code in (0, 1) and "error" not in err, (code, err)
        assert case.check(out, str(tmp_path)), (name, out[-2000:])
