"""A real server process on 127.0.0.1 and a real HTTP client (tests and benchmarks)."""

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

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["Server", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        # the checkout first, and whatever the caller's path has (an MLX installed
        # with pip --target, as on the H200)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
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

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int = 12, **extra: Any
    ) -> dict[str, Any]:
        """One chat completion; ``extra`` goes into the body (model, logprobs, ...)."""
        body = json.dumps(
            {"messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
        ).encode()
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
