"""The examples/ the README shows, run as a user runs them, on the tiny models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import ROOT


def example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_chat_session_resumes_across_processes(model_dir: Any, tmp_path: Path) -> None:
    args = ("--model", str(model_dir("llama")), "--store", str(tmp_path / "s"), "Hello there")
    first = example("chat_session.py", *args)
    assert "restored 0 tokens" in first
    saved = int(first.split("saved session 'chat': ")[1].split()[0])
    second = example("chat_session.py", *args)
    assert f"restored {saved} tokens" in second


def test_server_loop_reuses_the_shared_system_prompt(model_dir: Any, tmp_path: Path) -> None:
    out = example("server_loop.py", "--model", str(model_dir("llama")), "--store", str(tmp_path))
    reused = [int(line.split(": ")[1].split()[0]) for line in out.splitlines() if "reused" in line]
    assert reused[0] == 0 and all(r > 200 for r in reused[1:])


def test_hybrid_checkpoints_serve_later_questions(model_dir: Any, tmp_path: Path) -> None:
    out = example(
        "hybrid_checkpoints.py", "--model", str(model_dir("qwen3_next")), "--store", str(tmp_path)
    )
    reused = [
        int(line.split("reused ")[1].split()[0]) for line in out.splitlines() if "reused" in line
    ]
    assert len(reused) == 2 and all(r > 0 and r % 128 == 0 for r in reused)
