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

PER_TEST = 0.24  # seconds: the mean test of the files not listed below, same run

# The whole suite at -n 2 on main 7dbdf77, 30 Nov 06:11-06:33 UTC, in a fresh clone beside three
# helpers (load 5-9; docs/testing.md, "Ninth stop: the lead"): each file's tests' seconds (set-up,
# call, tear-down) from its JUnit report, the 70 longest; test_stream_overlap less the 58.5 s
# wait removed since. The figures before (29 Nov, scaled file by file since) ranked files by
# runs at other loads: suite9a found some 5-13x their CPU in tests today.
COST = {
    "remote/test_store_s3_read.py": 156,
    "store/test_crash_safety.py": 95,
    "remote/test_multihost_bucket_import.py": 72,
    "remote/test_tensorstore_from_bucket.py": 70,
    "io/test_dcp_fast.py": 63,
    "remote/test_restore_ocdbt_bucket.py": 58,
    "jobs/test_export_dcp.py": 55,
    "test_fuzz.py": 54,
    "remote/test_multihost_bucket.py": 48,
    "formats/test_titan_moe.py": 44,
    "remote/test_store_bucket_native.py": 40,
    "remote/test_store_s3.py": 39,
    "families/test_ernie4_5.py": 39,
    "families/test_tables.py": 36,
    "jobs/test_front_door.py": 36,
    "jobs/test_newcomer.py": 35,
    "families/test_deepseek_v3.py": 34,
    "formats/test_dcp.py": 34,
    "test_hostile.py": 31,
    "families/test_gemma.py": 31,
    "formats/test_megatron_dist.py": 31,
    "formats/test_megatron_moe.py": 29,
    "formats/test_deepspeed_moe.py": 28,
    "families/test_qwen3_moe.py": 27,
    "remote/test_store_s3_spool.py": 26,
    "test_readme.py": 24,
    "families/test_qwen2_moe.py": 23,
    "families/test_llama4.py": 22,
    "jobs/test_smaller_ones.py": 22,
    "jobs/test_model_agnostic.py": 22,
    "families/test_gpt_oss.py": 21,
    "remote/test_export_s3.py": 21,
    "formats/test_flex_checkpoint.py": 21,
    "formats/test_families_in_formats.py": 20,
    "families/test_qwen.py": 20,
    "formats/test_deepspeed.py": 20,
    "families/test_models.py": 20,
    "remote/test_formats_from_bucket.py": 19,
    "families/test_glm4_moe.py": 19,
    "remote/test_remote_markers.py": 19,
    "formats/test_megatron_dist_moe.py": 19,
    "jobs/test_export_dcp_tied.py": 18,
    "io/test_dcp_records_scale.py": 18,
    "formats/test_megatron.py": 18,
    "jobs/test_signals.py": 16,
    "jobs/test_train_resume.py": 16,
    "formats/test_moe_in_formats.py": 16,
    "formats/test_deepspeed_scale.py": 16,
    "families/test_qwen3_next.py": 16,
    "remote/test_remote_commands.py": 16,
    "formats/test_megatron_qwen.py": 15,
    "store/test_restore_direct.py": 14,
    "jobs/test_stored_dtypes.py": 14,
    "families/test_mixtral.py": 14,
    "families/test_deepseek_v32.py": 14,
    "store/test_codec.py": 14,
    "real/test_real_megatron.py": 14,
    "families/test_llama_rope.py": 12,
    "test_attacks.py": 12,
    "test_bounded.py": 12,
    "real/test_real_paddle.py": 12,
    "test_packaging.py": 12,
    "families/test_phi3.py": 11,
    "store/test_manager.py": 11,
    "real/test_real_index_names.py": 10,
    "jobs/test_steps.py": 10,
    "real/test_real_paddle_ernie.py": 10,
    "real/test_real_trainer.py": 10,
    "store/test_streaming.py": 9,
    "jobs/test_multiprocess.py": 9,
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
