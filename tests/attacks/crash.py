"""SIGKILL at seeded points of an import, an export and a training-save loop; what is left on
disk must be the previous complete checkpoint or nothing that looks complete.

A run starts the real command in a child process and watches the destination's parent. The
marker that writing has begun is the temporary sibling appearing (`.<name>.tmp-*`, or the
first step reported by the training loop); the child is then SIGKILLed after a delay drawn
from a seeded RNG over the write phase measured by one uninterrupted calibration run (some
delays fall after the end: the complete outcome). `outcome()` classifies what is left.
Shared by tests/store/test_crash_safety.py and benchmarks/reliability.py.
"""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

HIDDEN, LAYERS, VOCAB, FFN, HEADS = 64, 6, 512, 128, 4


def write_hf_source(folder: str, seed: int = 0) -> str:
    """An HF Llama checkpoint (config, weights, Adam moments) of a few MB: large enough that
    writing it takes many steps."""
    from hybridckpt.containers.safetensors_file import write

    rng = np.random.default_rng(seed)
    os.makedirs(folder)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
                   p + "self_attn.v_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    moments = {f"{k}.exp_avg": rng.standard_normal(s).astype(np.float32) * 1e-3 for k, s in shapes.items()}
    moments |= {f"{k}.exp_avg_sq": np.abs(rng.standard_normal(s)).astype(np.float32) * 1e-6 for k, s in shapes.items()}
    moments["step"] = np.asarray(5, np.int64)
    write(os.path.join(folder, "model.safetensors"), weights, {"format": "pt"})
    write(os.path.join(folder, "optimizer.safetensors"), moments, {"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS, "vocab_size": VOCAB, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybridckpt.cli", *args]


TRAIN_LOOP = r"""
import sys
import jax.numpy as jnp
from hybridckpt.store import CheckpointStore

store = CheckpointStore(sys.argv[1], max_to_keep=2, async_save=False)
for step in range(1, 1000):
    params = {"w": jnp.full((128, 256), step, jnp.float32), "b": jnp.full((4096,), -step, jnp.float32)}
    store.save(step, params, trainer_state={"loss": 1.0 / step})
    print(f"saved {step}", flush=True)
"""


def train_loop(directory: str) -> list[str]:
    return [sys.executable, "-c", TRAIN_LOOP, directory]


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    killed: bool  # the child was still running when the kill came
    returncode: int
    seconds_after_marker: float
    saved: list[int]  # steps the training loop reported as saved
    seconds_to_dst: float | None = None  # marker -> the destination appeared (the write phase)
    stderr: str = ""


def _marker(dst: str) -> bool:
    parent, name = os.path.dirname(dst), os.path.basename(dst)
    return bool(glob.glob(os.path.join(parent, f".{glob.escape(name)}.tmp-*"))) or os.path.exists(dst)


def run(argv: list[str], dst: str, delay: float | None, *, loop: bool = False, timeout: float = 120) -> Run:
    """Start `argv`; once the marker shows (`dst`'s temporary sibling, or a loop's first
    'saved' line), wait `delay` seconds and SIGKILL it (`delay=None`: let it finish)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    t_end = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    chunks: list[bytes] = []

    def drain() -> None:
        try:
            while data := os.read(fd, 65536):
                chunks.append(data)
        except BlockingIOError:
            pass

    while proc.poll() is None and time.monotonic() < t_end:
        drain()
        if (b"saved" in b"".join(chunks)) if loop else _marker(dst):
            break
        time.sleep(0.002)
    t0 = time.monotonic()
    killed = False
    to_dst = None
    watch = not loop and not os.path.exists(dst)
    while proc.poll() is None and time.monotonic() < t_end and (delay is None or time.monotonic() - t0 < delay):
        if watch and to_dst is None and os.path.exists(dst):
            to_dst = time.monotonic() - t0
        time.sleep(0.001)
    if delay is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        killed = True
    try:
        proc.wait(timeout=max(1.0, t_end - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    seconds = time.monotonic() - t0
    os.set_blocking(fd, True)
    chunks.append(proc.stdout.read())
    err = proc.stderr.read().decode(errors="replace")
    text = b"".join(chunks).decode(errors="replace")
    saved = [int(line.split()[1]) for line in text.splitlines() if line.startswith("saved ")]
    return Run(killed, proc.returncode, seconds, saved, to_dst, err[-3000:])


def kill_delays(seed: int, n: int, span: float) -> list[float]:
    """`n` seeded delays over [0, 1.15 * span]: most land inside the write phase."""
    rng = random.Random(seed)
    return sorted(round(rng.uniform(0.0, 1.15 * span), 4) for _ in range(n))


def leftovers(dst: str) -> list[str]:
    parent, name = os.path.dirname(dst), os.path.basename(dst)
    return sorted(glob.glob(os.path.join(parent, f".{glob.escape(name)}.*")))


def _quiet_main(argv: list[str]) -> tuple[int, str]:
    """`hybridckpt.cli.main(argv)` with its output captured."""
    import contextlib
    import io

    from hybridckpt.cli import main
    from hybridckpt.io.byte_source import close_all

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    close_all()
    return code, out.getvalue() + err.getvalue()


def import_outcome(dst: str) -> str:
    """'absent', 'complete' (every array matches the checksums recorded at import), or
    'bad: <why>'."""
    if not os.path.exists(dst):
        return "absent"
    code, text = _quiet_main(["verify", dst, "--quiet"])
    return "complete" if code == 0 else f"bad: verify exit {code}: {text[-300:]}"


def export_outcome(src: str, dst: str) -> str:
    """'absent', 'complete' (every tensor equals the source's, bit for bit), or 'bad: <why>'."""
    if not os.path.exists(dst):
        return "absent"
    code, text = _quiet_main(["verify", src, dst, "--quiet", "--params-only"])  # (the export has no optimizer)
    return "complete" if code == 0 else f"bad: verify exit {code}: {text[-300:]}"


def store_outcome(directory: str, saved: list[int]) -> str:
    """The store's latest step restores exactly and is not older than the last step the loop
    reported saved: 'complete' or 'bad: <why>' ('absent' when no step was ever committed)."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from hybridckpt.plan import abstract_tree
    from hybridckpt.store import CheckpointStore, load_params_metadata

    with CheckpointStore(directory) as store:
        steps = store.steps()
        if not steps:
            return "absent" if not saved else f"bad: no step, but the loop saved {saved}"
        step = steps[-1]
        if saved and step < saved[-1]:
            return f"bad: latest step {step} is older than the reported save {saved[-1]}"
        meta = load_params_metadata(directory, step)
        target = abstract_tree(meta, SingleDeviceSharding(jax.devices()[0]))
        got = store.restore(step, target_params=target)
    w, b = np.asarray(got.params["w"]), np.asarray(got.params["b"])
    if not (np.all(w == step) and np.all(b == -step)) or got.trainer_state.get("step") != step:
        return f"bad: step {step} restored other values"
    return "complete"


# -- the three kill experiments (tests/store/test_crash_safety.py, benchmarks/reliability.py) ------


@dataclass
class KillPoint:
    command: str
    delay: float
    overwrite: bool
    killed: bool
    outcome: str  # absent | complete | previous | bad: ...
    ok: bool


def _old_siblings(dst: str) -> list[str]:
    return [p for p in leftovers(dst) if ".old-" in p]


def kill_imports(src: str, previous_ckpt: str, workdir: str, *, seed: int, n: int) -> list[KillPoint]:
    """`hybridckpt import src DST` killed at `n` seeded points; every odd one replaces a
    complete checkpoint (`--overwrite`). OK: DST absent (and, when replacing, the previous
    checkpoint kept complete beside it), or DST complete (old or new)."""
    cal = os.path.join(workdir, "import-calibration")
    r = run(cli("import", src, cal, "--quiet"), cal, None)
    if r.returncode != 0 or import_outcome(cal) != "complete":
        raise RuntimeError(f"uninterrupted import failed: {r.stderr}")
    points = []
    for i, delay in enumerate(kill_delays(seed, n, r.seconds_to_dst or r.seconds_after_marker)):
        dst = os.path.join(workdir, f"import-kill{i}")
        args = ["import", src, dst, "--quiet"]
        over = bool(i % 2)
        if over:
            import shutil

            shutil.copytree(previous_ckpt, dst)
            args.append("--overwrite")
        k = run(cli(*args), dst, delay)
        got = import_outcome(dst)
        if got == "complete" and _imported_from(dst) != os.path.abspath(src):
            got = "previous"
        ok = got in ("absent", "complete", "previous")
        if over and got == "absent":
            old = _old_siblings(dst)
            ok = len(old) == 1 and import_outcome(old[0]) == "complete"
        points.append(KillPoint("import", delay, over, k.killed, got, ok))
    return points


def _imported_from(ckpt: str) -> str | None:
    from hybridckpt.store import read_trainer_state

    return (read_trainer_state(ckpt).get("source") or {}).get("path")


def kill_exports(src: str, previous_hf: str, workdir: str, *, seed: int, n: int) -> list[KillPoint]:
    """`hybridckpt export src OUT` killed at `n` seeded points; odd ones replace a complete HF
    folder (an export of `previous_hf`: `--overwrite` replaces only what hybridckpt wrote). OK:
    OUT absent (the previous one kept beside it when replacing), OUT equal to the source bit for
    bit, or OUT still the previous folder."""
    cal = os.path.join(workdir, "export-calibration")
    r = run(cli("export", src, cal, "--quiet"), cal, None)
    if r.returncode != 0 or export_outcome(src, cal) != "complete":
        raise RuntimeError(f"uninterrupted export failed: {r.stderr}")
    previous = os.path.join(workdir, "export-previous")
    p = run(cli("export", previous_hf, previous, "--quiet"), previous, None)
    if p.returncode != 0 or export_outcome(previous_hf, previous) != "complete":
        raise RuntimeError(f"export of the previous checkpoint failed: {p.stderr}")
    previous_hf = previous
    points = []
    for i, delay in enumerate(kill_delays(seed, n, r.seconds_to_dst or r.seconds_after_marker)):
        dst = os.path.join(workdir, f"export-kill{i}")
        args = ["export", src, dst, "--quiet"]
        over = bool(i % 2)
        if over:
            import shutil

            shutil.copytree(previous_hf, dst)
            args.append("--overwrite")
        k = run(cli(*args), dst, delay)
        got = export_outcome(src, dst)
        if over and got.startswith("bad") and export_outcome(previous_hf, dst) == "complete":
            got = "previous"
        ok = got in ("absent", "complete", "previous")
        if over and got == "absent":
            old = _old_siblings(dst)
            ok = len(old) == 1 and export_outcome(previous_hf, old[0]) == "complete"
        points.append(KillPoint("export", delay, over, k.killed, got, ok))
    return points


def kill_training(workdir: str, *, seed: int, n: int, span: float = 2.0) -> list[KillPoint]:
    """A CheckpointStore loop saving every step, killed at `n` seeded points over its first
    `span` seconds of saves. OK: the latest step restores exactly and is not older than the
    last step the loop reported saved."""
    points = []
    for i, delay in enumerate(kill_delays(seed, n, span)):
        directory = os.path.join(workdir, f"train-kill{i}")
        k = run(train_loop(directory), directory, delay, loop=True)
        got = store_outcome(directory, k.saved)
        points.append(KillPoint("training save", delay, False, k.killed, got, got == "complete" and k.killed))
    return points
