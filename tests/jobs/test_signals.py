"""Signals during a job (issue 37, issue 38 "Destinations"): SIGTERM (what `timeout` and job
schedulers send) is handled as Ctrl-C: one line, nothing left beside the destination, exit 143
(130 for SIGINT); a second signal adds nothing; on a terminal the progress bar is erased and never
drawn again after the line.

Each case runs the real command in a child process and sends the signal once its temporary folder
`.<name>.tmp-*` has appeared beside the destination (the write has begun); it checks the output,
the exit code and the folder's listing, never the time taken.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from hybridckpt import lazy, models, naming
from hybridckpt.formats.hf.write import write_hf

CLI = [sys.executable, "-m", "hybridckpt.cli"]
INTERRUPTED = b"hybridckpt: interrupted; nothing was written (a checkpoint already at the destination is kept)"
TERMINATED = b"hybridckpt: terminated (SIGTERM); nothing was written (a checkpoint already at the destination is kept)"


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    """An HF Llama of ~70 MB: seconds to import or export, so a signal sent as the write begins
    lands in the middle of it."""
    path = tmp_path_factory.mktemp("signals") / "src"
    cfg = models.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=6,
                             num_heads=4, num_kv_heads=2)
    rng = np.random.default_rng(0)
    flat = {k: lazy.ArrayTensor(rng.standard_normal(s).astype(np.float32))
            for k, s in naming.flatten(models.param_shape_tree(cfg)).items()}
    write_hf(str(path), naming.tree_to_hf(flat, cfg), models.config_to_hf(cfg))
    return str(path)


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets its own


def _wait_for_temporary(p: subprocess.Popen, dst: str) -> None:
    parent, name = os.path.split(dst)
    while p.poll() is None and not any(f.startswith(f".{name}.tmp-") for f in os.listdir(parent)):
        time.sleep(0.005)
    assert p.poll() is None, "the job ended before it began writing"


def _signalled(args: list[str], dst: str, signals: list[int], then: tuple[int, ...] = ()) -> tuple[int, bytes]:
    """Exit code and stderr of the command sent `signals` once it writes, and `then` once it has
    printed its first line to stderr (while its handler is at work)."""
    p = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    _wait_for_temporary(p, dst)
    for s in signals:
        p.send_signal(s)
    first = p.stderr.readline() if then else b""
    for s in then:
        p.send_signal(s)
    _, err = p.communicate(timeout=300)
    return p.returncode, first + err


JOBS = {
    "import": ["import", "{src}", "{dst}", "--quiet"],
    "export-hf": ["export", "{src}", "{dst}", "--quiet"],
    "export-maxtext": ["export", "{src}", "{dst}", "--quiet", "--to", "maxtext"],
    "export-dcp": ["export", "{src}", "{dst}", "--quiet", "--to", "dcp"],
}


@pytest.mark.parametrize("job", list(JOBS))
def test_sigterm_is_one_line_exit_143_and_leaves_nothing(src, tmp_path, job):
    dst = str(tmp_path / "dst")
    args = [a.format(src=src, dst=dst) for a in JOBS[job]]
    code, err = _signalled(args, dst, [signal.SIGTERM])
    assert (code, err) == (143, TERMINATED + b"\n")
    assert os.listdir(tmp_path) == []  # no destination, no .lock, no .tmp-*


@pytest.mark.parametrize("signals, then", [
    ([signal.SIGINT], (signal.SIGINT,)),
    ([signal.SIGTERM], (signal.SIGINT, signal.SIGTERM)),
    ([signal.SIGINT, signal.SIGINT, signal.SIGTERM], ()),
])
def test_repeated_signals_print_one_line(src, tmp_path, signals, then):
    """A second Ctrl-C while the first is handled adds nothing. Of signals pending together,
    whichever is handled first (in the order of their numbers, not of their sending) is the
    only one: one line, its exit code."""
    dst = str(tmp_path / "dst")
    got = _signalled(["import", src, dst, "--quiet"], dst, signals, then)
    first = {signal.SIGINT: (130, INTERRUPTED + b"\n"), signal.SIGTERM: (143, TERMINATED + b"\n")}
    assert got in ([first[signals[0]]] if then else list(first.values())), got
    assert os.listdir(tmp_path) == []


def test_sigterm_during_an_overwrite_keeps_the_previous_checkpoint(src, tmp_path):
    from hybridckpt.cli import main
    from hybridckpt.io.byte_source import close_all

    dst = str(tmp_path / "dst")
    try:  # the previous checkpoint (no signal: in this process)
        assert main(["export", src, dst, "--quiet"]) == 0
    finally:
        close_all()
    before = {f: open(os.path.join(dst, f), "rb").read() for f in os.listdir(dst)}
    code, err = _signalled(["export", src, dst, "--quiet", "--overwrite", "--dtype", "bfloat16"], dst, [signal.SIGTERM])
    assert (code, err) == (143, TERMINATED + b"\n")
    assert os.listdir(tmp_path) == ["dst"]
    assert {f: open(os.path.join(dst, f), "rb").read() for f in os.listdir(dst)} == before


def test_on_a_terminal_the_progress_bar_is_erased_and_never_drawn_after_the_line(src, tmp_path):
    """stdout and stderr on a pseudo-terminal (the bar draws there): once the bar has drawn,
    SIGINT; everything the command writes after its one line is nothing at all."""
    dst = str(tmp_path / "dst")
    leader, follower = pty.openpty()
    p = subprocess.Popen([*CLI, "import", src, dst], stdout=follower, stderr=follower, env=_env())
    os.close(follower)
    poller = select.poll()
    poller.register(leader, select.POLLIN)
    seen = b""
    sent = False
    deadline = time.monotonic() + 300  # (a guard against a hang, not a measure)
    while time.monotonic() < deadline:
        if not sent and b"import" in seen and any(f.startswith(".dst.tmp-") for f in os.listdir(tmp_path)):
            p.send_signal(signal.SIGINT)
            sent = True
        ready = poller.poll(50)  # (poll: select() fails on a descriptor numbered over 1023)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command has exited and the terminal is closed
                chunk = b""
            if not chunk:
                break
            seen += chunk
    os.close(leader)
    assert p.wait(timeout=60) == 130 and sent
    assert b"\x1b[" in seen.split(INTERRUPTED)[0]  # the bar did draw before
    before, line, after = seen.rpartition(INTERRUPTED)
    assert line and seen.count(INTERRUPTED) == 1
    assert after == b"\r\n", after[:400]  # nothing drawn after the line
    assert before.endswith(b"\x1b[2K"), before[-200:]  # the bar's lines erased first
    assert os.listdir(tmp_path) == []


def test_a_swap_in_progress_holds_sigterm_as_it_holds_sigint():
    """In the library (no CLI handler): a SIGTERM or SIGINT arriving while a finished folder is
    swapped into place reaches the program's handler only once the swap is done."""
    from hybridckpt.io import interrupts

    calls: list[tuple[int, bool]] = []
    inside = [False]
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for s in previous:
            signal.signal(s, lambda signum, frame: calls.append((signum, inside[0])))
        for s in (signal.SIGTERM, signal.SIGINT):
            with interrupts.committing():
                inside[0] = True
                os.kill(os.getpid(), s)
                for _ in range(1000):  # bytecodes run: a handler installed now would run here
                    pass
                inside[0] = False
        assert calls == [(signal.SIGTERM, False), (signal.SIGINT, False)]
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
