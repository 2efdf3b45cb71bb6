"""``persist serve`` for operators: a real server process and a real HTTP client.

Round 2 found (issue 26): ``{"prompt": ["a"]}`` ended the generation thread
(every later request 404, the process up, SIGTERM exit 0), a
``Content-Length: -1`` held a handler thread forever, there was no health
or metrics endpoint an operator could use, and GET /v1/models without a
Hugging Face cache logged a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.servers import ROOT, Server, free_port
from tests.serve.servers import get, hits, metrics, persist_serve, post, raw

# Each of these stopped generation for every later request, or the process (logit_bias).
MALFORMED: list[tuple[str, Any]] = [
    ("/v1/completions", {"prompt": ["a"]}),
    ("/v1/completions", {"prompt": ""}),
    ("/v1/completions", {"prompt": "a", "stop": [1]}),
    ("/v1/completions", {"prompt": "a", "stop": [["x"]]}),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999999": 5}}),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}),
    ("/v1/completions", {"prompt": "a", "seed": -1}),
    ("/v1/chat/completions", {"messages": ["hi"]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [5]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": "abc"}),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    ("/v1/completions", b"[1]"),
    ("/v1/completions", b"not json"),
]


def valid(srv: Server) -> tuple[int, dict[str, Any]]:
    return post(srv, "/v1/completions", {"prompt": "hello there, how", "max_tokens": 3})


def test_malformed_requests_get_400_and_generation_goes_on(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))  # does not exist
    log = tmp_path / "serve.log"
    srv = persist_serve(model_dir("llama"), tmp_path / "store", log)
    try:
        for path, body in MALFORMED:
            code, answer = post(srv, path, body)
            assert code == 400, (body, code, answer)
            assert "error" in answer, answer
            code, answer = valid(srv)
            assert code == 200, (body, answer)  # generation survived it
        code, models = get(srv, "/v1/models")
        assert code == 200 and json.loads(models)["object"] == "list"
        code, health = get(srv, "/health")
        assert code == 200 and json.loads(health)["generation"]["alive"] is True
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    text = log.read_text()
    assert "Traceback" not in text and "died" not in text, text[-3000:]


def test_unbounded_and_slow_requests_are_closed_while_others_are_served(
    model_dir: Any, tmp_path: Path
) -> None:
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "serve.log",
        "--request-timeout", "2", "--max-request-bytes", "64K",
    )  # fmt: skip
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    try:
        # mlx-lm read a Content-Length of -1 until the client closed: forever
        assert raw(srv, head + b"Content-Length: -1\r\n\r\n").startswith(b"HTTP/1.0 400")
        assert raw(srv, head + b"\r\n").startswith(b"HTTP/1.0 411")
        huge = head + b"Content-Length: 99999999999\r\n\r\n"
        assert raw(srv, huge).startswith(b"HTTP/1.0 413")
        # clients that stall: a body short of its length, headers never finished
        stalled: list[bytes] = []
        slow = [
            threading.Thread(target=lambda d=d: stalled.append(raw(srv, d)))
            for d in (head + b'Content-Length: 100\r\n\r\n{"pro', head + b"Content-Le")
        ]
        for t in slow:
            t.start()
        code, _ = valid(srv)  # served while both hold their connections
        assert code == 200
        for t in slow:
            t.join(timeout=120)
        # closed by the server well before the client's own 60 s wait
        assert len(stalled) == 2 and all(not t.is_alive() for t in slow)
        assert any(s.startswith(b"HTTP/1.0 408") for s in stalled), stalled
        assert valid(srv)[0] == 200
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


def test_health_metrics_and_json_logs(model_dir: Any, tmp_path: Path) -> None:
    store, log = tmp_path / "store", tmp_path / "a.log"
    chat = [{"role": "user", "content": "What does section 2 of the manual say? " * 4}]
    srv = persist_serve(model_dir("llama"), store, log, "--log-format", "json")
    try:
        code, body = get(srv, "/health")
        health = json.loads(body)
        assert code == 200 and health["status"] == "ok", health
        budget = health["store"].pop("budget_bytes")  # the default budget (persist config)
        assert isinstance(budget, int) and budget > 0, budget
        assert health["store"].pop("wal_bytes") >= 0  # the index's log, apart
        assert health["store"] == {
            "path": str(store), "reachable": True, "mode": "read-write", "state": "ok",
            "bytes": 0,
        }  # fmt: skip
        assert health["write_queue"]["depth"] == 0 and health["tiers"] == {}
        before = metrics(srv)
        srv.chat(chat)
        srv.chat(chat)  # the same prompt again: the memory tier has it
        after = metrics(srv)
        for _ in range(100):  # saves are written behind: wait for the first (no clock)
            if any(name == "persist_writes_total" for name, _ in after):
                break
            threading.Event().wait(0.1)
            after = metrics(srv)
        assert hits(after, "memory") > hits(before, "memory")
        assert after[("persist_cached_prompt_tokens_total", ())] > 0
        assert after[("persist_generation_alive", ())] == 1
        names = {name for name, _ in after}
        for name in (
            "persist_requests_total", "persist_prompt_tokens_total",
            "persist_save_seconds_bucket", "persist_tier_written_bytes_total",
            "persist_write_queue_depth", "persist_write_queue_drops_total",
            "persist_store_bytes", "persist_generation_thread_seconds_bucket",
        ):  # fmt: skip
            assert name in names, name
        # what persist added to the generation thread: each lookup and hand-off timed
        spent = "persist_generation_thread_seconds_count"
        for step in ("lookup", "handoff"):
            assert after[(spent, (("step", step),))] >= 2, step
    finally:
        srv.stop()
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert any("persistence on" in r["message"] and str(store) in r["message"] for r in records)
    stop = [r["message"] for r in records if "stopped" in r["message"]][-1]
    assert "requests" in stop and "{" not in stop, stop  # words, not a dict
    # a new process on the same store: the conversation comes from the local store
    again = persist_serve(model_dir("llama"), store, tmp_path / "b.log")
    try:
        before = metrics(again)
        again.chat(chat)
        after = metrics(again)
        assert hits(after, "local") == hits(before, "local") + 1
        assert after[("persist_tier_read_bytes_total", (("tier", "local"),))] > 0
        seconds = ("persist_restore_seconds_count", (("source", "local"),))
        assert after[seconds] == 1
    finally:
        again.stop()


def test_generation_that_cannot_go_on_exits_non_zero(model_dir: Any, tmp_path: Path) -> None:
    # a real failure: weights the generation thread cannot load (mlx-lm's server kept
    # listening, answered every request 404 and exited 0 on SIGTERM)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir("llama"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "persist", "serve", "--model", str(broken),
        "--store", str(tmp_path / "store"), "--port", str(free_port()),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=300).returncode  # fmt: skip
    text = log.read_text()
    assert code == 1, text[-3000:]
    assert "generation stopped for good" in text and "the model did not load" in text, text


@contextlib.contextmanager
def starting_server(
    model_dir: Any, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """``persist serve`` started, handed over once MLX is mapped: the command runs (it
    imports no MLX before), the server is not up yet.  Killed if still running after."""
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "persist", "serve", "--model", str(model_dir("llama")),
            "--store", str(tmp_path / "store"), "--port", str(free_port())]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "libmlx" not in Path(f"/proc/{proc.pid}/maps").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        yield proc, log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_the_model_loads_is_an_orderly_stop(model_dir: Any, tmp_path: Path) -> None:
    """Attack 39j: SIGTERM before the server listened (the model loading, its kernels
    built, the host tier pinned) ended the process at once: exit -15, no log line.
    systemd stops a unit that is still starting the same way as one that serves."""
    with starting_server(model_dir, tmp_path) as (proc, log):
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "stopped (SIGTERM) before it served" in text or "persist serve: stopped" in text, text
    assert "Traceback" not in text


def test_sigterms_while_it_starts_stop_it_in_order_or_at_once(
    model_dir: Any, tmp_path: Path
) -> None:
    """Attack 39k: SIGTERM every 5 ms from a starting server (a supervisor insisting)
    ended it by the signal (exit -15) after it had logged an orderly stop: a second
    signal stops at once (143), as after it listens; none is a kill."""
    with starting_server(model_dir, tmp_path) as (proc, log):
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        rc = proc.wait(timeout=10)
    text = log.read_text()
    assert rc in (0, 143), text[-3000:]
    assert "Traceback" not in text
