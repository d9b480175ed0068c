"""The order in which `-n 2` hands out the test files: the longest first.

pytest-xdist's `--dist loadfile` (pyproject.toml) gives each worker whole files, one at a time,
as it runs out; by default it deals them out by their number of tests, most first. Test counts
say little about time here: a file of 1 to 9 tests that trains a model in gloo ranks
(`jobs/test_export_dcp.py`, `formats/test_families_in_formats.py`) came last, so one worker ran
it alone at the end of the run while the other sat idle. `tests/conftest.py` sorts the
collected files by `cost` instead, longest first (xdist's own reordering is off:
`--no-loadscope-reorder`), so the short files fill the end of both workers' queues; the tests
of a file keep their order.

`COST`: seconds of each file's tests (set-up, call and tear-down summed from a JUnit report of
the whole suite at `-n 2`, docs/testing.md "Where the time goes"), rounded; only the order
matters, and a file not listed is estimated from its number of tests. A stale figure costs
only balance, never a result: every collected test runs, in any order.
"""

from __future__ import annotations

import os

PER_TEST = 0.07  # seconds: the mean test of the files not listed below, same run

# The whole suite at -n 2 on main 913e533, 30 Nov 09:39-09:46 UTC, in a fresh clone, nothing else
# running (docs/testing.md, "Tenth stop: the GCS emulator's waits"): each file's tests' seconds
# (set-up, call, tear-down) from its JUnit report, the 70 longest. The figures before (7dbdf77,
# load 5-9) had the GCS files at 2-10x these: their tests waited on dropped connections.
COST = {
    "remote/test_multihost_bucket_import.py": 28,
    "store/test_crash_safety.py": 24,
    "remote/test_restore_ocdbt_bucket.py": 24,
    "remote/test_multihost_bucket.py": 21,
    "test_fuzz.py": 21,
    "remote/test_formats_from_bucket.py": 18,
    "test_hostile.py": 17,
    "remote/test_store_s3_read.py": 15,
    "remote/test_store_bucket_native.py": 15,
    "formats/test_families_in_formats.py": 15,
    "formats/test_deepspeed.py": 13,
    "jobs/test_export_dcp.py": 13,
    "formats/test_deepspeed_moe.py": 12,
    "io/test_dcp_fast.py": 12,
    "formats/test_dcp.py": 11,
    "jobs/test_model_agnostic.py": 11,
    "formats/test_titan_moe.py": 10,
    "remote/test_store_s3.py": 10,
    "remote/test_remote_markers.py": 10,
    "families/test_deepseek_v3.py": 10,
    "jobs/test_newcomer.py": 10,
    "jobs/test_export_dcp_tied.py": 10,
    "test_readme.py": 10,
    "jobs/test_front_door.py": 9,
    "remote/test_export_s3.py": 9,
    "families/test_tables.py": 8,
    "remote/test_store_s3_spool.py": 8,
    "real/test_real_megatron.py": 8,
    "families/test_qwen3_next.py": 8,
    "store/test_mixed_leaves.py": 8,
    "remote/test_remote_commands.py": 7,
    "remote/test_tensorstore_from_bucket.py": 7,
    "jobs/test_signals.py": 7,
    "families/test_gemma.py": 7,
    "formats/test_megatron_dist_moe.py": 7,
    "test_bounded.py": 7,
    "jobs/test_multiprocess.py": 6,
    "families/test_qwen.py": 6,
    "formats/test_moe_in_formats.py": 6,
    "families/test_deepseek_v32.py": 6,
    "families/test_models.py": 6,
    "formats/test_megatron_moe.py": 6,
    "store/test_codec.py": 6,
    "families/test_llama_rope.py": 6,
    "families/test_gpt_oss.py": 6,
    "families/test_qwen3_moe.py": 6,
    "real/test_real_trainer.py": 5,
    "formats/test_megatron.py": 5,
    "formats/test_deepspeed_scale.py": 5,
    "formats/test_megatron_dist.py": 5,
    "real/test_real_paddle.py": 5,
    "families/test_ernie4_5.py": 5,
    "formats/test_flex_checkpoint.py": 5,
    "families/test_glm4_moe.py": 5,
    "store/test_orbax_io_quiet.py": 5,
    "families/test_dialects.py": 5,
    "families/test_llama4.py": 5,
    "jobs/test_cli_before_jax.py": 5,
    "jobs/test_train_resume.py": 4,
    "store/test_streaming.py": 4,
    "test_packaging.py": 4,
    "real/test_real_hf_quantized.py": 4,
    "store/test_manager.py": 4,
    "jobs/test_scale_dcp.py": 4,
    "formats/test_megatron_dist_jobs.py": 4,
    "formats/test_hf.py": 4,
    "real/test_real_hf524_fam_d.py": 4,
    "families/test_phi3.py": 4,
    "families/test_qwen2_moe.py": 4,
    "formats/test_megatron_mtp.py": 3,
}


def cost(relpath: str, tests: int) -> float:
    """The estimated seconds of the test file `relpath` (relative to tests/, `/`-separated)
    holding `tests` collected tests."""
    return COST.get(relpath, tests * PER_TEST)


def longest_first(items: list, tests_dir: str) -> list:
    """`items` (pytest's collected tests) with whole files in decreasing `cost`, each file's
    tests in their collected order; ties keep the collected order of the files."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)

    def key(path: str) -> float:
        rel = os.path.relpath(path, tests_dir).replace(os.sep, "/")
        return -cost(rel, len(files[path]))

    return [item for path in sorted(files, key=key) for item in files[path]]
