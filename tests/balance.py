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

PER_TEST = 0.5  # seconds: the mean test of the files not listed below, same run

COST = {  # the 60 longest files of the run at main ceb84f3 (29 Nov, 3362 tests, load 9 to 12)
    "store/test_crash_safety.py": 231,
    "jobs/test_newcomer.py": 211,
    "io/test_dcp_fast.py": 204,
    "jobs/test_front_door.py": 191,
    "families/test_gemma.py": 123,  # 155 s; suite8a: x its CPU ratio, fusion emitters off
    "families/test_models.py": 97,  # 140 s; suite8a: x its CPU ratio, fusion emitters off
    "remote/test_store_s3_spool.py": 136,
    "test_fuzz.py": 125,  # 253 s at 500/150 cases a target; the default profile runs half (29 Nov, suiteA7)
    "remote/test_multihost_bucket_import.py": 124,
    "test_hostile.py": 112,
    "families/test_llama_rope.py": 89,  # 108 s; suite8a: x its CPU ratio, fusion emitters off
    "remote/test_store_s3_read.py": 107,
    "formats/test_deepspeed.py": 94,
    "real/test_real_megatron.py": 71,  # 87 s; suite9c: x its CPU ratio, optax steps jitted
    "formats/test_families_in_formats.py": 80,
    "families/test_glm4_moe.py": 64,  # 79 s; suite8a: x its CPU ratio, fusion emitters off
    "families/test_llama4.py": 59,  # 78 s; suite8a: x its CPU ratio, fusion emitters off
    "families/test_deepseek_v3.py": 57,  # 77 s; suite8a: x its CPU ratio, fusion emitters off
    "remote/test_formats_from_bucket.py": 76,
    "families/test_qwen.py": 63,  # 76 s; suite8a: x its CPU ratio, fusion emitters off
    "families/test_dialects.py": 72,
    "families/test_qwen3_moe.py": 54,  # 70 s; suite8a: x its CPU ratio, fusion emitters off
    "jobs/test_export_dcp.py": 68,
    "real/test_real_trainer.py": 60,  # 67 s; suite9c: x its CPU ratio, optax step jitted
    "io/test_dcp_records_scale.py": 63,
    "formats/test_megatron_moe.py": 58,
    "remote/test_store_s3.py": 58,
    "families/test_qwen2_moe.py": 49,  # 57 s; suite8a: x its CPU ratio, fusion emitters off
    "families/test_ernie4_5.py": 44,  # 55 s; suite8a: x its CPU ratio, fusion emitters off
    "formats/test_megatron_dist.py": 55,
    "formats/test_titan_moe.py": 55,
    "remote/test_store_bucket_native.py": 52,
    "formats/test_dcp.py": 50,
    "families/test_tables.py": 49,
    "jobs/test_train_resume.py": 48,
    "formats/test_megatron.py": 47,
    "formats/test_flex_checkpoint.py": 47,
    "remote/test_restore_ocdbt_bucket.py": 47,
    "formats/test_megatron_dist_moe.py": 47,
    "families/test_gpt_oss.py": 46,
    "jobs/test_stored_dtypes.py": 45,
    "remote/test_remote_markers.py": 45,
    "jobs/test_smaller_ones.py": 44,
    "families/test_qwen3_next.py": 43,
    "families/test_mixtral.py": 43,
    "real/test_real_paddle.py": 43,
    "remote/test_export_s3.py": 41,
    "remote/test_multihost_bucket.py": 39,
    "families/test_qwen3_vl.py": 39,
    "formats/test_moe_in_formats.py": 39,
    "real/test_real_torchtitan.py": 39,
    "formats/test_deepspeed_moe.py": 38,
    "jobs/test_multiprocess.py": 38,
    "remote/test_remote_commands.py": 37,
    "test_readme.py": 36,
    "jobs/test_model_agnostic.py": 33,
    "jobs/test_export_dcp_tied.py": 32,
    "store/test_manager.py": 32,
    "real/test_real_hf_quantized.py": 31,
    "families/test_mistral.py": 30,
}

# After that run, the CLI of these files went in-process where the process was not the point
# (docs/testing.md, "The CLI in-process", 29 Nov): their figures above scaled by the CPU each
# file took before and after, measured one file at a time in the same session.
COST |= {
    "store/test_crash_safety.py": 159,
    "jobs/test_newcomer.py": 109,
    "jobs/test_front_door.py": 109,
    "test_hostile.py": 92,
}


# Less work in these files (docs/testing.md, "Less work in io/, remote/, ...", 30 Nov, suite8b):
# the figures above scaled by each file's CPU after / before, same session.
COST |= {
    "io/test_dcp_fast.py": 145,
    "formats/test_deepspeed.py": 81,
    "jobs/test_export_dcp.py": 63,
    "io/test_dcp_records_scale.py": 52,
}

# Each store downloaded once, "nothing touched" compared by one LIST (docs/testing.md, "Ninth
# stop: suite9b", 30 Nov): the figures above scaled by the CPU of the files' tests (set-up, call,
# tear-down, the moto server included) after / before, same session.
COST |= {
    "remote/test_multihost_bucket_import.py": 117,
    "remote/test_store_s3.py": 51,
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
