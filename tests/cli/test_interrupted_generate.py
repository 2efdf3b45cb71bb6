"""What a Ctrl-C or a closed pipe in `persist generate` keeps (the README says):
every turn finished before it and the turn so far, the store consistent, exit
status 130, and a line saying so.  Real processes, interrupted while they stream
their answer, a real pipe; and the library's stop between prefill chunks, bit for
bit against a fresh prefill.

Round 5's attack found ``persist generate ... | head -c 40`` exiting 0 with
nothing saved (a closed pipe was quiet success), and Ctrl-C saving nothing, not
even the prompt's prefill, with "persist: interrupted" glued to the answer's line.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import persist
from persist.apps.generate import generate, load_model
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, pythonpath


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


def _popen(home: Path, *args: str, **kw: Any) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PERSIST_HOME": str(home), "PYTHONPATH": pythonpath()}
    # a shell without job control starts background jobs with SIGINT ignored
    dfl = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    return subprocess.Popen([sys.executable, "-m", "persist", *args], env=env, preexec_fn=dfl, **kw)


def _shown(home: Path, store: Path, session: str) -> dict[str, Any]:
    out = persist_cli(home, "show", session, "--store", str(store), "--json")
    return dict(json.loads(out.stdout))


def test_closed_stdout_still_saves_the_turn_and_says_so(model_dir: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    p = _popen(
        tmp_path, "generate", "--model", str(model_dir("llama")), "--store", str(store),
        "--session", "piped", "--prompt", "Hello there", "--max-tokens", "24",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader left before the first byte of the answer (| head -c 0)
    err = p.stderr.read().decode()
    assert p.wait(timeout=300) == 0, err
    assert "stdout was closed" in err and "saved as session 'piped'" in err, err
    shown = _shown(tmp_path, store, "piped")
    prompt = persist_cli(tmp_path, "generate", "--model", str(model_dir("llama")),
                         "--store", str(tmp_path / "other"), "--session", "x",
                         "--prompt", "Hello there", "--max-tokens", "24", "--json")  # fmt: skip
    assert shown["tokens"] == json.loads(prompt.stdout)["session_tokens"]  # the whole turn


def test_ctrl_c_keeps_the_turn_so_far_and_the_next_turn_continues_it(
    model_dir: Any, tmp_path: Path
) -> None:
    store, model = tmp_path / "store", str(model_dir("llama"))
    p = _popen(
        tmp_path, "generate", "--model", model, "--store", str(store), "--session", "chat",
        "--prompt", "Hello there", "--max-tokens", "1000000",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert p.stdout is not None
    first = p.stdout.read(8)  # the answer is being written: generation is under way
    assert len(first) == 8
    p.send_signal(signal.SIGINT)
    rest = p.stdout.read().decode()
    assert p.wait(timeout=300) == 130, rest
    out = first.decode() + rest
    assert "\npersist: interrupted; kept the turn so far as session 'chat'" in out, out
    assert "Traceback" not in out, out
    kept = _shown(tmp_path, store, "chat")["tokens"]
    assert f": {kept} tokens (" in out, out
    nxt = persist_cli(tmp_path, "generate", "--model", model, "--store", str(store),
                      "--session", "chat", "--prompt", " more", "--max-tokens", "2",
                      "--json")  # fmt: skip
    got = json.loads(nxt.stdout)
    assert got["source"] == "session" and got["reused_tokens"] == kept, got


def test_a_stop_inside_the_prefill_keeps_exactly_the_prompt_so_far(
    tiny: Any, tmp_path: Path
) -> None:
    _, _, d = tiny("llama")
    model, tok, ident = load_model(d)
    asked: list[int] = []

    def stop_on_second_ask() -> bool:
        asked.append(1)
        return len(asked) >= 2  # asked first at 0 tokens, then after the first chunk

    with persist.Store(tmp_path / "s") as store:
        r = generate(
            model, tok, ident, store, session="long", prompt="the quick brown fox " * 4,
            max_tokens=8, prefill_step_size=8, should_stop=stop_on_second_ask,
        )  # fmt: skip
        assert r.interrupted and r.saved and r.generated_tokens == 0
        assert r.session_tokens == 8
        restored = store.restore("long", identity=ident)
        assert restored.tokens == list(tok.encode("the quick brown fox " * 4,
                                                  add_special_tokens=False))[:8]  # fmt: skip
        fresh, _ = prefill(model, restored.tokens, step=8)
        mx.eval([c.state for c in restored.cache])
        assert_same_state(live_state(restored.cache), live_state(fresh))
