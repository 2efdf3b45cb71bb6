"""Every request is bounded, and names only allowed models.

Found from outside (round 5's attack): a non-streaming request with ``max_tokens: 100000000``
whose client hung up kept generating (a core busy, memory rising) and SIGTERM
waited the whole ``--drain-timeout`` for it; ``max_tokens`` was checked for
its type only.  A request's ``model`` loaded any folder the server could
read, and its error said whether files existed (``No such file or
directory: '/etc/config.json'``).  A real server process, real sockets.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from persist.apps.demo import make_model
from persist.serve.bounds import capped, context_length
from tests.serve.servers import metrics, persist_serve, post, scrape

FORCED = {"65": 100.0}  # always token "A": never an EOS, so only the length ends it


def _wait_for(probe: Any, what: str, seconds: float = 120.0) -> Any:
    """Poll ``probe`` until it returns something true (a bounded wait, not a timing)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}")


def _abandon(srv: Server, body: dict[str, Any]) -> None:
    """Send a request, wait until its prompt reached generation, and hang up."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    before = metrics(srv).get(("persist_prompt_tokens_total", ()), 0.0)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(head + data)
        _wait_for(
            lambda: metrics(srv).get(("persist_prompt_tokens_total", ()), 0.0) > before,
            "the request to reach generation",
        )


def test_abandoned_request_stops_generating_and_does_not_hold_the_drain(
    model_dir: Any, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", log,
        "--max-tokens-limit", "100000000", "--drain-timeout", "3600",
    )  # fmt: skip
    try:
        # above the operator's limit: 400 in OpenAI's shape, naming the field
        code, answer = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 100000001})
        assert code == 400 and answer["error"]["param"] == "max_tokens", answer
        assert answer["error"]["type"] == "invalid_request_error"
        code, answer = post(
            srv, "/v1/completions", {"prompt": "hi", "max_completion_tokens": 100000001}
        )
        assert code == 400 and answer["error"]["param"] == "max_completion_tokens", answer

        _abandon(srv, {"prompt": "tell me everything", "max_tokens": 100000000,
                       "logit_bias": FORCED})  # fmt: skip
        gone = ("persist_requests_total", (("code", "499"), ("endpoint", "/v1/completions")))
        _wait_for(lambda: metrics(srv).get(gone, 0.0) == 1.0, "the abandoned request to end")
        assert metrics(srv)[("persist_requests_abandoned_total", ())] == 1.0
        # mlx-lm drops a stopped request when its step budget ends, before it takes the
        # next request: after one more request, nothing more is generated for nobody
        wasted = []
        for _ in range(2):
            code, answer = post(srv, "/v1/completions", {"prompt": "next", "max_tokens": 8,
                                                         "logit_bias": FORCED})  # fmt: skip
            assert code == 200 and answer["usage"]["completion_tokens"] == 8, answer
            wasted.append(metrics(srv)[("persist_abandoned_tokens_total", ())])
        assert wasted[0] == wasted[1], wasted
    finally:
        srv.stop()  # SIGTERM: waits at most 120 s, while --drain-timeout is an hour
    assert srv.proc.returncode == 0
    text = log.read_text()
    assert "unfinished at the deadline" not in text, text[-3000:]
    assert "a client closed its connection" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


@pytest.fixture
def short_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose stated context is 40 tokens."""
    d = tmp_path_factory.mktemp("ctx40") / "llama-ctx40"
    return make_model(d, "llama", overrides={"max_position_embeddings": 40})


def test_answers_fit_the_context_and_only_allowed_models_are_named(
    short_context: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    outside = tmp_path / "outside"
    make_model(outside, "llama", seed=1)  # a real model folder the server could read
    srv = persist_serve(short_context, tmp_path / "store", log)
    try:
        prompt = "abcdefghij"  # 10 byte tokens
        code, answer = post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1000,
                                                     "logit_bias": FORCED})  # fmt: skip
        assert code == 200, answer
        used = answer["usage"]
        assert used["prompt_tokens"] + used["completion_tokens"] == 40, used
        code, answer = post(srv, "/v1/completions", {"prompt": "x" * 60, "max_tokens": 4})
        assert code == 400 and "context" in answer["error"]["message"], answer

        # the served model under its names: served, the same model (no second load)
        for name in ("default_model", str(short_context)):
            code, answer = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                         "model": name})  # fmt: skip
            assert code == 200, (name, answer)
        # anything else: one refusal, the same words whether the path exists or not
        said = []
        for field, name in [
            ("model", str(outside)), ("model", "/etc"), ("model", "/no/such/folder"),
            ("model", "mlx-community/Llama-3.2-1B-Instruct-4bit"),
            ("draft_model", str(outside)), ("adapters", "/etc"),
        ]:  # fmt: skip
            code, answer = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                         field: name})  # fmt: skip
            assert code == 404, (field, name, answer)
            err = answer["error"]
            assert err["code"] == "model_not_found" and err["param"] == field, answer
            said.append(err["message"].replace(f"{field} {name!r}", "NAME", 1))
        assert len(set(said)) == 1, said
        assert "No such file" not in said[0] and "exist" not in said[0], said
        ids = [m["id"] for m in json.loads(scrape(srv, "/v1/models"))["data"]]
        assert str(outside) not in ids
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    assert str(outside) + "/config.json" not in log.read_text()


def test_a_closed_socket_is_told_from_a_quiet_one_and_abandoning_stops_its_context() -> None:
    from mlx_lm.server import GenerationContext, Response

    from persist.serve.disconnect import AbandonableQueue, closed

    here, there = socket.socketpair()
    assert not closed(here)  # a client waiting quietly for its answer
    there.sendall(b"GET")  # bytes waiting (a pipelined request) are not a hang-up
    assert not closed(here) and here.recv(3) == b"GET"
    there.close()
    assert closed(here)
    here.close()
    # a client that pipelined bytes the server never read, then hung up (an outside
    # attack: a peek saw the bytes, never the EOF behind them)
    here, there = socket.socketpair()
    there.sendall(b"POST /v1/completions HTTP/1.1\r\n" * 100)
    assert not closed(here)
    there.close()
    assert closed(here)
    here.close()

    wasted: list[int] = []
    q = AbandonableQueue(lambda: wasted.append(1))
    q.abandon()  # before the generation thread handed over the context
    ctx = GenerationContext(False, False, None, None, "normal", [1, 2])  # type: ignore[arg-type]
    q.put(ctx)
    assert ctx._should_stop  # stopped as it arrives
    q.put(Response("a", 65, 0.0, None, ()))  # type: ignore[arg-type]
    assert wasted == [1] and q.wasted == 1


def test_a_context_the_config_never_states_is_no_limit(tiny: Any, short_context: Path) -> None:
    """mlx-lm's mamba2 args default ``max_position_embeddings`` to 2056 when the config
    says nothing; persist serve refused every longer prompt (outside attack, round 3).
    Only a stated context bounds a request."""
    model, _, model_dir = tiny("mamba2")
    assert "max_position_embeddings" not in json.loads((model_dir / "config.json").read_text())
    assert context_length(model) is None
    assert capped(5000, 2100, context_length(model)) == 5000
    from mlx_lm.utils import load

    stated, _ = load(str(short_context))[:2]
    assert context_length(stated) == 40
