"""The CLI keeps a turn or says it did not (issue 38, finding 10).

Found from outside: ``persist generate ... | head -c 40`` exited 0 and saved
nothing (a closed pipe was quiet success); Ctrl-C saved nothing, not even the
prompt's prefill, and "persist: interrupted" was glued to the answer's line.
Real ``persist generate`` processes, a real pipe, a real SIGINT; and the
library's stop between prefill chunks, bit for bit against a fresh prefill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

import persist
from persist.apps.generate import generate, load_model
from tests.helpers import assert_same_state, live_state, persist_cli, prefill, pythonpath


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
