"""What a person sees: ``persist generate`` under a pseudo-terminal, read through a
terminal emulator (pyte), and the progress bar's arithmetic with an injected clock."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyte

from persist.cli import terminal
from tests.helpers import ROOT

# generate with the bars' threshold set: 0 draws every bar, as slow work would; 1e9 none
RUN = (
    "import sys; import persist.cli.terminal as t; t.BAR_AFTER_S = float(sys.argv[1]); "
    "from persist.cli import main; sys.argv = ['persist', *sys.argv[2:]]; main()"
)


def on_a_terminal(after: float, *args: str, env: dict[str, str]) -> list[str]:
    """Run persist with stdout and stderr on one pseudo-terminal; the screen's lines."""
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, "-c", RUN, str(after), *args],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
    )
    os.close(slave)
    raw = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            p.kill()
            raise AssertionError(f"no output for 120 s: {raw[-2000:]!r}")
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        raw += chunk
    assert p.wait(timeout=60) == 0, raw[-3000:]
    os.close(master)
    screen = pyte.Screen(200, 50)
    stream = pyte.ByteStream(screen)
    stream.feed(raw)  # the pty turned each \n into \r\n, as a terminal does
    return [line.rstrip() for line in screen.display if line.strip()]


def twin_answer(home: Path, args: list[str], env: dict[str, str]) -> str:
    """The answer the same turn gives, from a copy of the store, through a pipe."""
    twin = home.with_name(home.name + "-twin")
    shutil.rmtree(twin, ignore_errors=True)
    if home.exists():
        shutil.copytree(home, twin)
    cmd = [sys.executable, "-m", "persist", *args, "--json"]
    out = subprocess.run(
        cmd, env={**env, "PERSIST_HOME": str(twin)}, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    text = str(json.loads(out.stdout)["text"])
    assert text.strip() and text.isprintable()  # something a screen shows
    return text


def test_the_answer_stays_on_screen_with_and_without_bars(tmp_path: Path, model_dir: Any) -> None:
    """In a terminal the answer (stdout, no newline of its own) was erased by the save
    bar (stderr, starting with \\r): only the bars and the status line remained."""
    home = tmp_path / "home"
    env = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": str(ROOT)}
    args = ["generate", "--model", str(model_dir("llama")), "--session", "s", "-m", "12"]
    # over two blocks of 256 tokens: the save reports progress a bar could draw
    first = [*args, "--prompt", "one two three four five six seven. " * 20 + "Hello there"]
    answer = twin_answer(home, first, env)
    quick = on_a_terminal(1e9, *first, env=env)  # no bar (quick work; clock-free)
    assert quick[0] == answer, quick  # its own line
    assert quick[1].startswith("[s] 0 of ") and len(quick) == 2, quick
    more = [*args, "--prompt", " Hello there"]
    answer = twin_answer(home, more, env)
    slow = on_a_terminal(0.0, *more, env=env)  # every bar drawn, as for slow work
    assert answer in slow, slow  # the bars come before and after it, never over it
    after = slow[slow.index(answer) + 1 :]
    assert any(line.startswith("save [") for line in after), slow
    assert after[-1].startswith("[s] ") and "from the store (session)" in after[-1], slow


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_time_left_counts_from_the_first_report() -> None:
    """prime reported '9 s left' at 21% of a 61 s run: the work before the bar's first
    report (resumed tokens, the first chunk) was counted as done in no time."""
    now = [0.0]
    out = Tty()
    bar = terminal.Bar("prefill", file=out, clock=lambda: now[0], after=0.5)
    now[0] = 12.0
    bar(210, 1000)  # the first report, after 12 s of work
    now[0] = 24.0
    bar(420, 1000)  # 210 tokens in 12 s since: 580 left is about 33 s
    assert bar.left(420, 1000, 24.0) == 12.0 / 210 * 580
    assert out.getvalue().endswith("42%  33 s left\x1b[K")
    now[0] = 30.0
    bar(1000, 1000)
    assert out.getvalue().endswith("100%\x1b[K\n") and bar.closed


def test_no_bar_off_a_terminal_or_for_quick_work() -> None:
    now = [0.0]
    pipe = io.StringIO()
    bar = terminal.Bar("save", file=pipe, clock=lambda: now[0], after=0.5)
    now[0] = 5.0
    bar(1, 2)
    bar(2, 2)
    assert pipe.getvalue() == ""  # not a terminal
    tty = Tty()
    quick = terminal.Bar("save", file=tty, clock=lambda: now[0], after=0.5)
    now[0] = 5.2
    quick(1, 2)
    quick(2, 2)
    assert tty.getvalue() == ""  # done within 0.5 s
