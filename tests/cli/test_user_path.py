"""The user's path: interrupted primes, two writers on one session, what ls hides,
identity mismatches that say which model, one display name.  Real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import persist
from persist.apps import generate as gen_mod
from tests.helpers import ROOT, persist_cli

TEXT = " ".join(f"line {i} of a long manual about caches." for i in range(60))


def cli(home: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return persist_cli(home, *args, check=check)


def test_an_interrupted_prime_resumes_and_rm_takes_its_checkpoints(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("qwen3_next")  # recurrent: checkpoints are what it resumes from
    ident = persist.ModelIdentity.of(model, tok)
    tokens = tok.encode(TEXT, add_special_tokens=False)
    home = tmp_path / "home"
    # What Ctrl-C during `persist prime` leaves: checkpoints, no session.
    with persist.Store(home) as store:
        persist.prefill(
            model, tokens[:300], store=store, identity=ident, session="docs", checkpoint_every=64
        )
        assert not store.sessions() and len(store.entries()) == 4
    out = cli(home, "ls")
    assert "no sessions" in out.stdout and "4 checkpoints" in out.stdout
    assert "persist ls --all" in out.stdout
    m = str(model_dir("qwen3_next"))
    again = json.loads(
        cli(home, "prime", "--model", m, "--session", "docs", "--prompt", TEXT,
            "--checkpoint-every", "64", "--json").stdout
    )  # fmt: skip
    assert again["reused_tokens"] == 256  # the deepest checkpoint
    with persist.Store(home) as store:
        marks = [e.tokens for e in store.entries() if e.role == "checkpoint"]
        assert len(marks) == len(set(marks)) == len(tokens) // 64  # none stored twice
        assert store.entry("docs").tokens == len(tokens)
    cli(home, "rm", "docs")
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"
    # checkpoints alone (an interrupted prime) are removed by name too
    with persist.Store(home) as store:
        persist.prefill(
            model, tokens[:200], store=store, identity=ident, session="half", checkpoint_every=64
        )
    cli(home, "rm", "half")
    assert cli(home, "ls", "--all", "--json").stdout.strip() == "[]"


def test_a_turn_that_lost_a_race_is_kept_under_a_new_name(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    with persist.Store(tmp_path / "s") as store:
        gen_mod.generate(model, tok, ident, store, session="work", prompt="hello", max_tokens=3)
        real = gen_mod.resume_text

        def racing(*a: Any, **k: Any) -> Any:
            got = real(*a, **k)  # another process saves a turn after this one read
            other = store.restore("work", identity=ident)
            store.save(other.cache, other.tokens, identity=ident, session="work")
            return got

        monkeypatch.setattr(gen_mod, "resume_text", racing)
        r = gen_mod.generate(model, tok, ident, store, session="work", prompt="again", max_tokens=3)
        assert r.session == "work~2" and r.conflict_with == "work"
        assert {e.session for e in store.sessions()} == {"work", "work~2"}
        with pytest.raises(persist.SessionConflictError) as e:
            store.save(
                other_cache(store, ident), [1, 2, 3], identity=ident, session="work", if_version=1
            )
        assert isinstance(e.value, RuntimeError) and "nothing was saved" in str(e.value)


def other_cache(store: persist.Store, ident: Any, n: int = 3) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for _ in range(max(1, ident.layers)):  # as many layers as the identity's model makes
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        out.append(c)
    return out


def test_two_generates_at_once_never_lose_a_turn(model_dir: Any, tmp_path: Path) -> None:
    env = {**os.environ, "PERSIST_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    m = str(model_dir("llama"))
    base = [sys.executable, "-m", "persist", "generate", "--model", m, "--session", "work"]
    subprocess.run([*base, "--prompt", "start", "--max-tokens", "2"], env=env, check=True)
    procs = [
        subprocess.Popen(
            [*base, "--prompt", p, "--max-tokens", "4", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in ("first writer", "second writer")
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    names = sorted(r["session"] for r in results)
    if names == ["work", "work"]:  # one ran after the other: it resumed the first's turn
        a, b = sorted(results, key=lambda r: r["session_tokens"])
        assert b["reused_tokens"] == a["session_tokens"]
    else:
        assert names == ["work", "work~2"]
        assert any(r["conflict_with"] == "work" for r in results)


def test_ls_says_what_it_hides(tmp_path: Path) -> None:
    from tests.golden.cases import IDENTITY

    home = tmp_path / "home"
    with persist.Store(home) as store:
        for i in range(3):
            store.save(
                other_cache(store, IDENTITY, 20 + i), list(range(i, 20 + 2 * i)), identity=IDENTITY
            )
    out = cli(home, "ls").stdout
    assert out.splitlines() == [
        "no sessions",
        "also 3 prefixes (prompts persist serve cached): persist ls --all lists them",
    ]
    assert len(json.loads(cli(home, "ls", "--all", "--json").stdout)) == 3


def test_a_session_for_another_model_names_both(model_dir: Any, tmp_path: Path) -> None:
    home = tmp_path / "home"
    cli(home, "generate", "--model", str(model_dir("llama")), "--session", "w", "--prompt", "hi",
        "--max-tokens", "2")  # fmt: skip
    bad = cli(home, "generate", "--model", str(model_dir("gemma3")), "--session", "w",
              "--prompt", "hi", "--max-tokens", "2", check=False)  # fmt: skip
    assert bad.returncode == 1
    assert "saved for another model (llama " in bad.stderr and "this is gemma3" in bad.stderr
    assert "; pass --model with the model it was saved for" in bad.stderr
    listed = json.loads(cli(home, "ls", "--json").stdout)
    assert [e["model"] for e in listed] == ["llama"]  # the model_type, as from Python


def test_chats_keep_their_turns_and_share_a_system_prompt(model_dir: Any, tmp_path: Path) -> None:
    home = tmp_path / "home"
    m = str(model_dir("llama"))
    system = "You are a terse assistant who answers in one short line, always. " * 3

    def chat(session: str, prompt: str, *extra: str) -> dict[str, Any]:
        args = ["generate", "--model", m, "--session", session, "--chat", "--prompt", prompt]
        return dict(json.loads(cli(home, *args, "--max-tokens", "4", *extra, "--json").stdout))

    first = chat("c1", "What is a cache?", "--system", system)
    second = chat("c1", "And a prefix?")
    assert second["source"] == "session" and second["reused_tokens"] == first["session_tokens"]
    other = chat("c2", "Something else.", "--system", system)
    assert other["source"] == "prefix" and other["reused_tokens"] > len(system) // 2
    with persist.Store(home) as store:
        messages = json.loads(store.entry("c1").metadata["persist.chat"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    raw = cli(home, "generate", "--model", m, "--session", "c1", "--prompt", "x", check=False)
    assert raw.returncode == 1 and "continue it with --chat" in raw.stderr
    bad = cli(home, "generate", "--model", m, "--session", "t", "--system", "s", "--prompt", "x",
              check=False)  # fmt: skip
    assert bad.returncode == 2 and "--system needs --chat" in bad.stderr
