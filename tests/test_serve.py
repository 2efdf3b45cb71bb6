"""``persist serve``: a real server process on 127.0.0.1 and a real HTTP client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import ROOT

SYSTEM = (
    "You are the assistant of a hardware manual. " * 6
    + "Section 1 says: install the device. Section 2 says: configure it."
)
TURN1 = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What does section 2 say?"},
]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "It says to configure it."},
    {"role": "user", "content": "And section 1?"},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError("server did not start")

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = json.dumps({"messages": messages, "temperature": 0, "max_tokens": 12}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return dict(json.loads(r.read()))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=120)
        self.log.close()


def persist_serve(model: Path, store: Path, log: Path) -> Server:
    return Server(["persist", "serve", "--model", str(model), "--store", str(store)], log)


def text(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["message"]["content"])


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("variant", ["llama", "qwen3_next", "gemma3"])
def test_restart_keeps_the_prompt_cache(variant: str, model_dir: Any, tmp_path: Path) -> None:
    model = model_dir(variant)
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:
        want = plain.chat(TURN2)
    finally:
        plain.stop()
    store = tmp_path / "store"
    first = persist_serve(model, store, tmp_path / "a.log")
    try:
        one = first.chat(TURN1)
    finally:
        first.stop()  # SIGTERM: the write-behind queue is flushed
    assert cached(one) == 0
    second = persist_serve(model, store, tmp_path / "b.log")
    try:
        got = second.chat(TURN2)
    finally:
        second.stop()
    # the earlier conversation (system prompt and first question) came from the store
    assert cached(got) >= one["usage"]["prompt_tokens"] - 8
    assert text(got) == text(want)
    with persist.Store(store) as s:
        assert s.check() == []
        assert s.stats().counters["serve_store_hits"] == 1


def test_sigkill_during_write_behind(model_dir: Any, tmp_path: Path) -> None:
    model = model_dir("llama")
    store = tmp_path / "store"
    srv = persist_serve(model, store, tmp_path / "a.log")
    try:
        srv.chat(TURN1)
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the first turn is durable
            with persist.Store(store) as s:
                if s.entries():
                    break
            time.sleep(0.2)
        srv.chat(
            [
                *TURN1,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "something else " * 30},
            ]
        )
    finally:
        srv.stop(signal.SIGKILL)  # likely while writing the second turn behind
    with persist.Store(store) as s:
        problems = s.check(fix=True)
        assert {p.kind for p in problems} <= {"orphan-tmp", "orphan-blob"}, problems
        assert s.check() == []
    again = persist_serve(model, store, tmp_path / "b.log")
    try:
        assert cached(again.chat(TURN2)) > 0
    finally:
        again.stop()
