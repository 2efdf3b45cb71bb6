"""``persist serve``'s operator edge under hostile use: sampler values past MLX's
limits, JSON the parser chokes on, bad requests, a full disk, control characters
in request lines, generation that stops for good, slow clients and image URLs.

Each test is a real ``persist serve`` process on 127.0.0.1 and a real HTTP
client (urllib or a raw socket).  Each case was found by an attack from outside
on the operator's claims (round 2) and committed as a strict xfail; the fixes
removed the markers, so each now guards its fix.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.servers import ROOT, Server, free_port
from tests.serve.servers import get, metrics, persist_serve

HUGE_TOP_K = 100_000  # past the vocabulary of every tiny test model (260 tokens)


def post(srv: Server, path: str, body: Any, timeout: float = 300) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def valid(srv: Server) -> int:
    return post(srv, "/v1/completions", {"prompt": "hello there, how", "max_tokens": 3})[0]


def raw(port: int, data: bytes, wait: float = 120.0) -> bytes:
    """Send ``data`` as is and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def raw_post(port: int, path: str, body: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (path.encode(), len(body))
    return raw(port, head + body)


def error_shape(body: bytes) -> bool:
    """The documented error body: {"error": {"message": ..., "type": ..., "param": ...}}."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


@pytest.fixture(scope="module")
def shared_server(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the checks that leave it serving (stateless requests)."""
    d = tmp_path_factory.mktemp("operator_edge")
    srv = persist_serve(model_dir("llama"), d / "store", d / "serve.log")
    try:
        yield srv
    finally:
        srv.stop()


# -- 1. sampling values that pass validation and fail the generation loop --------------


def test_sampler_values_past_mlx_limits_are_400_and_never_stop_generation(
    model_dir: Any, tmp_path: Path
) -> None:
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "serve.log")
    bad = [
        {"prompt": "hello there", "max_tokens": 3, "temperature": 1.0, "top_k": HUGE_TOP_K},
        {"prompt": "hello there", "max_tokens": 3, "temperature": 1.0,
         "xtc_probability": 0.5, "xtc_threshold": 0.9},
        # mlx-lm slices with 32-bit indices: 2**32 raised in generation (an outside attack)
        {"prompt": "hello there", "max_tokens": 2, "repetition_penalty": 1.5,
         "repetition_context_size": 1 << 32},
    ]  # fmt: skip
    try:
        codes = [post(srv, "/v1/completions", bad[i % 3], timeout=120)[0] for i in range(6)]
        time.sleep(2)  # the generation watcher polls every 0.5 s
        assert srv.proc.poll() is None, "the process exited after bad requests"
        assert codes == [400] * 6, codes
        assert valid(srv) == 200
    finally:
        srv.stop()


# long: 11 s (a 3,000-token answer); sampler refusals without a batch run in the quick run
@pytest.mark.long
def test_a_bad_sampler_value_does_not_fail_the_other_requests_of_its_batch(
    model_dir: Any, tmp_path: Path
) -> None:
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "serve.log")
    try:
        body = json.dumps(
            {"prompt": "tell me a long story", "max_tokens": 3000, "stream": True}
        ).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection(("127.0.0.1", srv.port)) as s:
            s.settimeout(300)
            s.sendall(head + body)
            got = b""
            while got.count(b"data:") < 2:  # generating: it sits in the batch
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
            post(
                srv, "/v1/completions",
                {"prompt": "x", "max_tokens": 2, "temperature": 1.0, "top_k": HUGE_TOP_K},
                timeout=120,
            )  # fmt: skip
            while chunk := s.recv(65536):
                got += chunk
        assert b"data: [DONE]" in got, got[-500:]
    finally:
        srv.stop()


# -- 2. JSON the parser refuses with something other than JSONDecodeError -----------------


@pytest.mark.parametrize("kind", ["long_int", "deep"])
def test_pathological_json_gets_400(shared_server: Server, kind: str) -> None:
    body = (
        b'{"prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}"
        if kind == "long_int"
        else b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    answer = raw_post(shared_server.port, "/v1/completions", body)
    assert valid(shared_server) == 200
    assert answer.startswith(b"HTTP/1.0 400"), answer[:200]


# -- 3. bad requests answered 404 with mlx-lm's flat body ---------------------------------

FLAT: list[tuple[str, Any]] = [
    ("lone_surrogate", ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}')),
    ("image_on_text_model", ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})),
    ("tool_call_arguments", ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "assistant", "content": "x",
         "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "hi"}]})),
    ("tool_call_function_string", ("/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "assistant", "content": "x", "tool_calls": [{"function": "f"}]},
        {"role": "user", "content": "hi"}]})),
    ("chat_template_kwargs_tokenize", ("/v1/chat/completions", {
        "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tokenize": False}})),
    ("xtc_probability_int", ("/v1/completions", {"prompt": "a", "xtc_probability": 1})),
]  # fmt: skip


@pytest.mark.parametrize("case", [c for _, c in FLAT], ids=[n for n, _ in FLAT])
def test_every_bad_request_is_400_with_the_documented_error_body(
    shared_server: Server, case: tuple[str, Any]
) -> None:
    path, body = case
    code, answer = post(shared_server, path, body)
    assert valid(shared_server) == 200
    assert code == 400 and error_shape(answer), (code, answer[:300])


# -- 4. stream_options without include_usage ----------------------------------------------


def test_stream_options_without_include_usage_streams_to_done(shared_server: Server) -> None:
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "stream_options": {}}
    code, answer = post(shared_server, "/v1/completions", body)
    assert code == 200
    assert answer.rstrip().endswith(b"data: [DONE]"), answer[-300:]


# -- 5. a full disk takes generation down -------------------------------------------------


def test_a_full_store_disk_never_fails_requests(model_dir: Any, tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr!r}")
    srv = None
    try:
        srv = persist_serve(model_dir("llama"), mnt / "store", tmp_path / "serve.log")
        assert valid(srv) == 200
        # the disk is full from here on (unbuffered: closing has nothing left to flush)
        with (mnt / "fill").open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        codes = [
            post(srv, "/v1/completions", {"prompt": f"prompt number {i} here", "max_tokens": 2},
                 timeout=120)[0]
            for i in range(7)
        ]  # fmt: skip
        time.sleep(2)
        assert srv.proc.poll() is None, "the process exited on a full disk"
        assert codes == [200] * 7, codes
        health = json.loads(get(srv, "/health")[1])  # the operator sees why nothing is saved
        assert health["status"] == "degraded" and health["store"]["state"] == "full", health
    finally:
        if srv is not None:
            srv.stop()
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- 6. store bytes after a restart -------------------------------------------------------


def test_store_bytes_are_the_stores_bytes_after_a_restart(model_dir: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    first = persist_serve(model_dir("llama"), store, tmp_path / "a.log")
    try:
        first.chat([{"role": "user", "content": "Remember this sentence, please. " * 4}])
    finally:
        first.stop()
    again = persist_serve(model_dir("llama"), store, tmp_path / "b.log")
    try:
        health = json.loads(get(again, "/health")[1])
        gauge = metrics(again)[("persist_store_bytes", ())]
    finally:
        again.stop()
    assert "(1 entries" in (tmp_path / "b.log").read_text()  # the start line: the store holds it
    assert health["store"]["bytes"] > 0 and gauge > 0, (health["store"], gauge)


# -- 7. control characters into the text log ----------------------------------------------


def test_request_lines_cannot_write_control_characters_into_the_log(
    shared_server: Server,
) -> None:
    raw(shared_server.port, b"GET /health\x1b[2J\x1b[31mRED HTTP/1.0\r\n\r\n")
    raw(shared_server.port, b"GET /x\r2026-01-01 00:00:00,000 - ERROR - FORGED HTTP/1.0\r\n\r\n")
    assert get(shared_server, "/health")[0] == 200  # the access lines are logged by now
    logged = Path(shared_server.log.name).read_bytes()
    assert b"\x1b" not in logged and b"\r" not in logged, [
        ln for ln in logged.split(b"\n") if b"\x1b" in ln or b"\r" in ln
    ]


# -- 8. --log-format json: the exit line ---------------------------------------------------


def test_json_logs_stay_json_when_generation_stops_for_good(model_dir: Any, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model_dir("llama"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    log = tmp_path / "serve.log"
    cmd = [
        sys.executable, "-m", "persist", "serve", "--model", str(broken), "--log-format", "json",
        "--store", str(tmp_path / "store"), "--host", "127.0.0.1", "--port", str(free_port()),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=300).returncode  # fmt: skip
    assert code == 1
    not_json = []
    for line in log.read_text().splitlines():
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not not_json, not_json


# -- 9. requests answered by http.server are not counted ----------------------------------


def test_requests_total_counts_every_answered_request(shared_server: Server) -> None:
    def total() -> float:
        return sum(v for (n, _), v in metrics(shared_server).items()
                   if n == "persist_requests_total")  # fmt: skip

    before = total()  # this scrape is counted once answered: +1 below
    port = shared_server.port
    assert raw(port, b"GET /a b HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 400")
    assert raw(port, b"PUT /v1/completions HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 501")
    assert raw(port, b"OPTIONS /v1/completions HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 204")
    assert total() - before == 1 + 3


# -- 10. slow clients: no cap on connections ----------------------------------------------


def test_health_answers_while_many_slow_clients_hold_connections(
    model_dir: Any, tmp_path: Path
) -> None:
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "serve.log")
    socks: list[socket.socket] = []
    try:
        # what a systemd unit's default soft limit (1024) allows, scaled down
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")  # headers never finished
            socks.append(s)
        time.sleep(1)
        code, _ = get(srv, "/health", timeout=15)  # well inside --request-timeout (30 s)
        assert code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()


# -- 11. the server fetches URLs it is given ----------------------------------------------


def test_image_urls_are_not_fetched_for_a_text_model(shared_server: Server) -> None:
    marker = "fetched-by-the-server"
    url = f"http://127.0.0.1:{shared_server.port}/health?{marker}"
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    post(shared_server, "/v1/chat/completions", body)
    assert get(shared_server, "/health")[0] == 200
    assert marker not in Path(shared_server.log.name).read_text(errors="replace")


def test_a_content_length_given_twice_is_400(shared_server: Server) -> None:
    # attack r15: two Content-Length headers (39, then 5) were taken, the first used;
    # RFC 9112 6.3 makes differing ones an error (a request-smuggling seam behind a proxy)
    body = b'{"prompt": "a", "max_tokens": 2}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
    answer = raw(shared_server.port, head + b"Content-Length: 5\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"Content-Length" in answer
