"""The CLI with click's CliRunner and as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import persist
from persist.apps.demo import make_model
from persist.cli.app import cli
from tests.helpers import ROOT, assert_same_state, live_state


def run(*args: str, ok: bool = True) -> Any:
    from persist.cli import (  # noqa: F401
        files,
        main,
        models,
        sessions,
    )

    res = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if ok:
        assert res.exit_code == 0, res.output
    return res


def js(*args: str) -> Any:
    return json.loads(run(*args, "--json").stdout)


@pytest.fixture
def store(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def gen(model: str, store: str, session: str, prompt: str, max_tokens: int = 12) -> list[str]:
    """The arguments of a `persist generate` run."""
    return [
        "generate",
        "--model",
        model,
        "--store",
        store,
        "--session",
        session,
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
    ]


def test_generate_twice_resumes_the_session(store: str, model_dir: Any) -> None:
    m = str(model_dir("llama"))
    first = js(*gen(m, store, "w", "Once upon a time", 12))
    assert first["reused_tokens"] == 0 and first["source"] == "none"
    second = js(*gen(m, store, "w", " and then", 12))
    assert second["source"] == "session"
    assert second["reused_tokens"] == first["session_tokens"]  # every stored token reused
    assert second["prompt_tokens"] == first["session_tokens"] + len(" and then")
    shown = js("show", "w", "--store", store)
    assert shown["tokens"] == second["session_tokens"]
    # the library agrees with ls/show/stats
    with persist.Store(store) as s:
        assert [e.to_dict() for e in s.sessions()] == js("ls", "--store", store)
        assert js("stats", "--store", store)["entries"] == s.stats().entries == 1


def test_streamed_text_equals_json_text(tmp_path: Path, model_dir: Any) -> None:
    m = str(model_dir("llama"))
    args = ["generate", "--model", m, "--session", "t", "--prompt", "Hello", "--max-tokens", "9"]
    streamed = run(*args, "--store", str(tmp_path / "a"))
    as_json = json.loads(run(*args, "--store", str(tmp_path / "b"), "--json").stdout)
    assert as_json["text"] and streamed.stdout == as_json["text"] + "\n"
    assert "0 of 5 prompt tokens from the store" in streamed.stderr


def test_prime_with_checkpoints_then_generate_reuses_prefix(store: str, model_dir: Any) -> None:
    m = str(model_dir("qwen3_next"))
    text = "The quick brown fox jumps over the lazy dog. " * 12
    primed = js(
        "prime",
        "--model",
        m,
        "--store",
        store,
        "--session",
        "doc",
        "--prompt",
        text,
        "--checkpoint-every",
        "64",
    )
    assert primed["checkpoints"] == len(text) // 64
    out = js(
        "generate",
        "--model",
        m,
        "--store",
        store,
        "--session",
        "new",
        "--prompt",
        text[:300] + " What next?",
        "--max-tokens",
        "4",
    )
    assert out["source"] == "prefix" and out["reused_tokens"] == 256
    assert len(js("ls", "--all", "--store", store)) == 2 + len(text) // 64


def test_rm_gc_and_check(store: str, model_dir: Any, tmp_path: Path) -> None:
    m = str(model_dir("llama"))
    for name in ("a", "b", "c"):
        run(*gen(m, store, name, f"session {name} " * 40, 4))
    run("rm", "a", "--store", store)
    assert [e["session"] for e in js("ls", "--store", store)] == ["b", "c"]
    before = js("stats", "--store", store)
    budget = str(before["unique_bytes"] - 1)  # one entry must go
    plan = js("gc", "--store", store, "--max-bytes", budget, "--dry-run")
    assert plan["dry_run"] and [e["session"] for e in plan["evicted"]] == ["b"]
    assert js("stats", "--store", store)["unique_bytes"] == before["unique_bytes"]
    done = js("gc", "--store", store, "--max-bytes", budget)
    assert done["bytes_freed"] == plan["bytes_freed"]
    assert (
        js("stats", "--store", store)["unique_bytes"]
        == before["unique_bytes"] - done["bytes_freed"]
    )
    # damage: delete a blob, drop an orphan file
    with persist.Store(store) as s:
        victim = next((Path(store) / "blobs").rglob("*.safetensors"))
        victim.unlink()
        (victim.parent / f"{'0' * 32}.{'1' * 12}.safetensors").write_bytes(b"junk")
    bad = run("check", "--store", store, ok=False)
    assert bad.exit_code == 1
    run("check", "--fix", "--store", store)
    assert js("check", "--store", store) == []
    with persist.Store(store) as s:
        assert s.check() == []


def test_export_import_round_trip(store: str, model_dir: Any, tiny: Any, tmp_path: Path) -> None:
    m = str(model_dir("gemma3"))
    run(*gen(m, store, "g", "a sliding window that wraps " * 4, 8))
    f = tmp_path / "g.safetensors"
    run("export", "g", str(f), "--store", store)
    other = str(tmp_path / "other")
    run("import", str(f), "--session", "copy", "--store", other)
    model, tok, _ = tiny("gemma3")
    ident = persist.ModelIdentity.of(model, tok, name="gemma3")
    with persist.Store(store) as a, persist.Store(other) as b:
        x = a.restore("g", identity=ident)
        y = b.restore("copy", identity=ident)
        assert x.tokens == y.tokens
        assert_same_state(live_state(x.cache), live_state(y.cache))


def one_error_line(res: Any) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith("persist: error: ")
    return lines[0]


def test_bad_inputs_exit_1_with_one_line(store: str, model_dir: Any, tmp_path: Path) -> None:
    m = str(model_dir("llama"))
    run(*gen(m, store, "s", "x " * 200, 2))
    assert "no session 'nope'" in one_error_line(run("show", "nope", "--store", store, ok=False))
    assert "no session" in one_error_line(run("rm", "nope", "--store", store, ok=False))
    other = make_model(tmp_path / "other", "llama", seed=7)
    line = one_error_line(
        run(
            "generate",
            "--model",
            str(other),
            "--store",
            store,
            "--session",
            "s",
            "--prompt",
            "more",
            ok=False,
        )
    )
    assert "weights" in line
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14)
    assert "not a persist file" in one_error_line(
        run("import", str(junk), "--store", store, ok=False)
    )
    blob = next((Path(store) / "blobs").rglob("*.safetensors"))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    line = one_error_line(
        run("export", "s", str(tmp_path / "x.safetensors"), "--store", store, ok=False)
    )
    assert "checksum mismatch" in line
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root ignores permissions; use a path under a regular file
        one_error_line(run("ls", "--store", str(locked / "s"), ok=False))
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    assert "error" in one_error_line(run("ls", "--store", str(not_dir / "s"), ok=False))


COMMANDS = [
    "generate",
    "prime",
    "ls",
    "show",
    "rm",
    "gc",
    "check",
    "stats",
    "export",
    "import",
    "make-model",
    "inspect",
    "verify",
]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_has_an_example(command: str) -> None:
    out = run(command, "--help").stdout
    assert "Example:" in out and f"persist {command}" in out


def test_real_subprocess(tmp_path: Path, model_dir: Any) -> None:
    env = {**os.environ, "PERSIST_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        "-m",
        "persist",
        "generate",
        "--model",
        str(model_dir("llama")),
        "--session",
        "p",
        "--prompt",
        "hello",
        "--max-tokens",
        "3",
        "--json",
    ]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert json.loads(second.stdout)["reused_tokens"] == json.loads(first.stdout)["session_tokens"]
    bad = subprocess.run(
        [sys.executable, "-m", "persist", "show", "nope"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 1 and bad.stderr.startswith("persist: error: ")
    usage = subprocess.run(
        [sys.executable, "-m", "persist", "gc", "--bogus"], env=env, capture_output=True, text=True
    )
    assert usage.returncode == 2
