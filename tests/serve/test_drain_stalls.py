"""SIGTERM's drain waits only for responses someone reads.

Found from outside (round 5, attack 38b finding 9): a streaming client that
stayed connected and read nothing held the drain for the whole
``--drain-timeout`` (60 s by default): it had not closed its socket, so the
hang-up watch never fired.  Now a response whose client takes nothing for
``DRAIN_STALL`` seconds is cut off in the drain, while a client that reads is
served to its end.  A real server process, real sockets: a client with a
4 KiB receive buffer that never reads, and one that reads its stream.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from tests.serve.servers import metrics, persist_serve

FORCED = {"65": 100.0}  # always token "A": never an EOS, so only the length ends it


def _wait_for(probe: Any, what: str, seconds: float = 120.0) -> None:
    """Poll ``probe`` until it is true (a bounded wait, not a timing)."""
    deadline = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def _request(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def _read_all(sock: socket.socket, got: list[bytes]) -> None:
    while True:
        try:
            part = sock.recv(1 << 16)
        except OSError:
            return
        if not part:
            return
        got.append(part)


def test_the_drain_cuts_off_a_stream_nobody_reads_and_serves_one_that_is_read(
    model_dir: Any, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", log, "--drain-timeout", "3600",
        "--max-tokens-limit", "1000000",
    )  # fmt: skip
    prompts = ("persist_prompt_tokens_total", ())
    try:
        before = metrics(srv).get(prompts, 0.0)
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        silent.connect(("127.0.0.1", srv.port))
        silent.sendall(_request({"prompt": "tell me a story", "max_tokens": 1000000,
                                 "stream": True, "logit_bias": FORCED}))  # fmt: skip
        _wait_for(lambda: metrics(srv).get(prompts, 0.0) > before, "the silent stream to start")
        reader = socket.create_connection(("127.0.0.1", srv.port))
        reader.sendall(_request({"prompt": "and you?", "max_tokens": 3000, "stream": True,
                                 "logit_bias": FORCED}))  # fmt: skip
        got: list[bytes] = []
        t = threading.Thread(target=_read_all, args=(reader, got), daemon=True)
        t.start()
        _wait_for(lambda: b"data: " in b"".join(got), "the read stream to start")
        srv.proc.send_signal(signal.SIGTERM)  # the drain: one stream read, one not
        srv.proc.wait(timeout=300)  # bounded here, while --drain-timeout is an hour
        t.join(timeout=60)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        srv.log.close()
    text = log.read_text()
    assert srv.proc.returncode == 0, text[-3000:]
    assert "unfinished at the deadline" not in text, text[-3000:]
    assert "cut off 1 response in the drain" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    answer = b"".join(got).decode()
    events = [json.loads(e[6:]) for e in answer.split("\n\n") if e.startswith("data: {")]
    assert answer.rstrip().endswith("data: [DONE]"), answer[-500:]  # served to its end
    assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
    silent.close()
    reader.close()
