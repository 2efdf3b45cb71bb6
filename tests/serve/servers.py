"""What the tests of ``persist serve`` share: the conversations they send, a server
process, plain HTTP requests against it and what its answers and /metrics say
(the process itself is bench/servers.py's ``Server``)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.servers import Server

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
# another conversation: with mlx-lm's prompt cache of one entry it evicts TURN1's
OTHER = [
    {"role": "system", "content": "You answer questions about gardening. " * 8},
    {"role": "user", "content": "When should I plant tulips?"},
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def persist_serve(model: Path, store: Path, log: Path, *extra: str) -> Server:
    return Server(["persist", "serve", "--model", str(model), "--store", str(store), *extra], log)


def text(resp: dict[str, Any]) -> str:
    return str(resp["choices"][0]["message"]["content"])


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def post(srv: Server, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST ``body`` (JSON, or bytes as they are); the status and the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", data=data)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(srv: Server, path: str, timeout: float = 60) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(srv: Server, path: str) -> bytes:
    """A GET that must succeed: its body."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=60) as r:
        return bytes(r.read())


def metrics(srv: Server) -> Samples:
    """Every sample /metrics gives, by name and labels."""
    code, body = get(srv, "/metrics")
    assert code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    }


def hits(m: Samples, source: str) -> float:
    """The prompt cache's hits from ``source`` (memory, host, local, shared, cold)."""
    key = ("persist_cache_lookups_total", (("result", "hit"), ("source", source)))
    return m.get(key, 0.0)


def written(srv: Server, wait: float = 60.0) -> None:
    """Wait until the write-behind has written every cache it was given (bounded)."""
    deadline = time.monotonic() + wait
    while metrics(srv).get(("persist_write_queue_depth", ()), 0.0) > 0:
        assert time.monotonic() < deadline, "the write-behind did not finish in time"
        time.sleep(0.05)


def raw(srv: Server, data: bytes, wait: float = 60.0) -> bytes:
    """Send ``data`` as is and read until the server closes (or ``wait`` passes)."""
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.settimeout(wait)
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
