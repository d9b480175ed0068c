"""The command line refuses what it can refuse before loading JAX (issue 42's test wall time: a CLI
launch spent about 0.9 s of its 1.6 s importing JAX even when it ended in a usage error).

Each case runs the command as a user does (`python -m hybridckpt.cli`, a subprocess) under
`python -X importtime`, which lists on stderr every module the process imported: the heavy ones
(JAX, Orbax, Flax, TensorStore, torch) must not be among them, and the one-line error and exit
code must be what they were. An `import` with a mistyped mesh or codec, of a source that does
not exist, and `logits` of a source that does not exist loaded JAX before; `--help`, argparse's
usage errors, `inspect` of another format, `verify` of a store's checksums and exports never
did (kept here so they stay that way); `inspect` of one of our stores did.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridckpt.demo import sample_path

HEAVY = ("jax", "jaxlib", "orbax", "flax", "tensorstore", "optax", "torch")


def launch(*args: str, cwd) -> tuple[int, str, str, set[str]]:
    """(exit code, stdout, stderr without the import-time lines, the top-level packages imported)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "hybridckpt.cli", *args], capture_output=True,
                       text=True, cwd=cwd, env=env, timeout=300)
    imported, rest = set(), []
    for line in r.stderr.splitlines(keepends=True):
        if line.startswith("import time:"):
            name = line.rsplit("|", 1)[-1].strip()
            imported.add(name.split(".")[0])
        else:
            rest.append(line)
    assert "hybridckpt" in imported  # (the listing is there: an empty one would prove nothing)
    return r.returncode, r.stdout, "".join(rest), imported


CASES = {
    "help": (["--help"], 0, None),
    "import help": (["import", "--help"], 0, None),
    "usage error": (["import"], 2, "the following arguments are required: src, dst"),
    "mesh typed wrong": (["import", "{sample}", "ck", "--mesh", "tp=0"], 2,
                         "bad mesh 'tp=0': sizes must be positive, found tp=0"),
    "unknown axis": (["import", "{sample}", "ck", "--mesh", "ep=2"], 2,
                     "bad mesh 'ep=2': unknown axis 'ep'; the axes are dp, fsdp, tp, pp"),
    "codec typed wrong": (["import", "{sample}", "ck", "--compression", "zip"], 2,
                          "--compression 'zip': expected none, zstd"),
    "no such source": (["import", "nothing", "ck"], 2, "nothing: no such file or directory"),
    "logits of no such source": (["logits", "nothing", "--tokens", "1,2"], 2, "nothing: no such file or directory"),
    "inspect": (["inspect", "{sample}"], 0, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_what_is_refused_or_read_without_jax_never_loads_it(case, tmp_path):
    args, code, message = CASES[case]
    args = [a.format(sample=sample_path()) for a in args]
    rc, out, err, imported = launch(*args, cwd=tmp_path)
    assert rc == code, (case, rc, out, err)
    if message is None:
        assert err == "" and out, (case, err)
    else:
        assert err.count("\n") == 1 and err.startswith("hybridckpt: error: ") and message in err, (case, err)
    assert not imported & set(HEAVY), (case, sorted(imported & set(HEAVY)))
    assert os.listdir(tmp_path) == [], (case, os.listdir(tmp_path))  # nothing written, nothing beside


def test_an_import_that_runs_still_loads_jax_and_says_its_devices(tmp_path):
    """The other side: a mesh that parses goes on to JAX (the listing sees it), and the import's
    summary is the one it was. Orbax and TensorStore write the store; optax and Flax are not
    loaded (the AdamW state is planned from its declared layout, `optim.abstract_state(declared=True)`: optax
    and the jax.scipy it imports were 141 modules of the 1487 an import loaded)."""
    rc, out, err, imported = launch("import", sample_path(), "ck", "--quiet", cwd=tmp_path)
    assert rc == 0 and err == "", err
    assert {"jax", "orbax", "tensorstore"} <= imported
    assert not imported & {"optax", "flax", "chex"}, sorted(imported & {"optax", "flax", "chex"})
    assert "24 optimizer arrays" in out or "with optimizer state" in out, out  # (the AdamW state was imported)
    assert "at step 12 on mesh dp=1,fsdp=1,tp=1,pp=1 (1 of " in out, out
    assert os.listdir(tmp_path) == ["ck"]


def test_our_store_is_inspected_verified_and_exported_without_jax(tmp_path):
    """`inspect` of one of our stores loaded JAX and Orbax (for a step list its folder names
    already gave); `verify` of its checksums and `export` of it never did."""
    from hybridckpt import jobs

    jobs.import_checkpoint(sample_path(), str(tmp_path / "ck"))  # (in this process: JAX is loaded here)
    rc, out, err, imported = launch("inspect", "ck", cwd=tmp_path)
    assert rc == 0 and err == "" and "format:    orbax" in out and "step:      12" in out, (out, err)
    assert "tensors:   12 (" in out, out
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    rc, out, err, imported = launch("verify", "ck", cwd=tmp_path)
    assert rc == 0 and "37/37 arrays match their import checksums" in out, (out, err)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    rc, out, err, imported = launch("export", "ck", "out", "--quiet", cwd=tmp_path)
    assert rc == 0 and out.startswith("exported orbax checkpoint to "), (out, err)
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert sorted(os.listdir(tmp_path)) == ["ck", "out"]
