"""What a Ctrl-C in `persist generate` keeps (the README says): every turn
finished before it, the store consistent, exit status 130.  A real process,
interrupted while it streams its answer."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import persist
from tests.helpers import persist_cli, pythonpath


def tokens_of(home: Path, file: Path) -> list[int]:
    """Session s's tokens, as an export writes them."""
    with persist.Store(home) as store:
        store.export("s", file)
    return list(persist.load_file(file).tokens)


def first_output(proc: subprocess.Popen[bytes], limit: float) -> bytes:
    """Wait (at most ``limit`` seconds, a bound, not a measurement) for the answer's
    first bytes on stdout."""
    assert proc.stdout is not None
    end = time.monotonic() + limit
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            return os.read(proc.stdout.fileno(), 4096)
        assert proc.poll() is None, "generate ended before it was interrupted"
    raise AssertionError("no answer on stdout")


def test_ctrl_c_while_answering_keeps_the_last_finished_turn(tmp_path: Path) -> None:
    # the demo model, as the README runs it: its answer to this prompt has no EOS, so
    # the Ctrl-C always lands while it streams (never after the turn's save)
    home = tmp_path / "home"
    persist_cli(home, "generate", "--session", "s", "--prompt", "Hello", "--max-tokens", "8")
    before = tokens_of(home, tmp_path / "before.safetensors")
    env = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": pythonpath()}
    env["PYTHONUNBUFFERED"] = "1"  # the answer streams through the pipe as it is made
    proc = subprocess.Popen(
        [sys.executable, "-m", "persist", "generate", "--session", "s", "--prompt", " more",
         "--max-tokens", "1000000"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # a shell without job control starts background jobs with SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        assert first_output(proc, 240)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode(errors="replace")[-2000:]
    assert b"interrupted" in err and b"Traceback" not in err
    # the finished turn is intact (what the interrupted one adds, if anything, follows it)
    after = tokens_of(home, tmp_path / "after.safetensors")
    assert after[: len(before)] == before
    with persist.Store(home) as store:
        assert store.check() == []
