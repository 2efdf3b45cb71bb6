"""An S3-compatible server that ignores ``If-Match`` / ``If-None-Match`` is found at first
write and refused, loudly: on it a session pointer's compare-and-set always wins,
so two machines would replace each other's sessions without a word.

Real moto S3 server; the server that ignores the conditions is moto behind a
real HTTP proxy (a thread on 127.0.0.1) that drops those two headers, as some
S3-compatible stores do.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.golden.cases import IDENTITY, kv_cache

KEY = bytes(range(32))
TOKENS = list(range(100, 148))
DROPPED = {"if-match", "if-none-match"}


def proxy_to(port: int) -> ThreadingHTTPServer:
    """An HTTP proxy to 127.0.0.1:``port`` that forwards every request without the
    conditional headers."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(n) if n else None
            keep = {k: v for k, v in self.headers.items() if k.lower() not in DROPPED}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request(self.command, self.path, body=body, headers=keep)
            got = conn.getresponse()
            data = got.read()
            self.send_response(got.status)
            for k, v in got.getheaders():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            conn.close()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = forward

        def log_message(self, *_: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def unconditional(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto behind the proxy: AWS_ENDPOINT_URL points at the proxy."""
    server = proxy_to(s3_server.port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield s3_server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def objects(s3: Any) -> list[str]:
    got = s3.client().list_objects_v2(Bucket="persist-test").get("Contents", [])
    return [o["Key"] for o in got]


def test_a_server_that_ignores_conditional_writes_gets_no_session(
    unconditional: Any, tmp_path: Path
) -> None:
    with persist.Store(tmp_path / "a", tier_key=KEY, cold=unconditional.url) as a:
        a.save([kv_cache(48, 1)], TOKENS, identity=IDENTITY, session="chat")
    assert [k for k in objects(unconditional) if "/sess/" in k] == []


def test_a_server_that_ignores_conditional_writes_is_named_in_the_sync_report(
    unconditional: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with persist.Store(tmp_path / "a", tier_key=KEY, cold=unconditional.url) as a:
        a.save([kv_cache(48, 1)], TOKENS, identity=IDENTITY, session="chat")
        assert a.sync()["tiers"]["cold"]["failed"] == 1
    assert any("ignores If-None-Match" in r.getMessage() for r in caplog.records)


def test_the_conditional_write_probe_leaves_nothing_behind(s3_server: Any, tmp_path: Path) -> None:
    with persist.Store(tmp_path / "a", tier_key=KEY, cold=s3_server.url) as a:
        a.save([kv_cache(48, 1)], TOKENS, identity=IDENTITY, session="chat")
    with persist.Store(tmp_path / "c", tier_key=KEY, cold=s3_server.url) as c:
        assert c.restore("chat", identity=IDENTITY).tokens == TOKENS
    assert [k for k in objects(s3_server) if "probe" in k] == []
