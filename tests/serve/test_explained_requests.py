"""A ``persist serve`` client asks why its prompt was not reused (``X-Persist-Explain``)
and gets the verdict in a header, in the JSON answer and in the server log; /metrics
counts misses by reason.  Real server processes, a real HTTP client, real stores."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from persist.engine.explain import REASONS
from tests.serve.servers import TURN1, TURN2, metrics, persist_serve, written

ASK = {"X-Persist-Explain": "1"}


def chat(
    srv: Server, messages: list[dict[str, Any]], headers: dict[str, str], **extra: Any
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, raw body) of one chat completion."""
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, **extra}
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def said(header: str) -> dict[str, str]:
    return dict(part.strip().split("=") for part in header.split(";"))


def misses(srv: Server) -> dict[str, float]:
    return {
        dict(labels)["reason"]: v
        for (name, labels), v in metrics(srv).items()
        if name == "persist_misses_total"
    }


def asking(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer briefly. " * 20},
            {"role": "user", "content": text}]  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("explained")
    srv = persist_serve(model_dir("llama"), tmp / "store", tmp / "s.log")
    try:
        yield srv
    finally:
        srv.stop()


def test_a_cold_prompt_is_told_empty_in_header_body_and_log(server: Server) -> None:
    code, headers, raw = chat(server, asking("What is the first rule?"), ASK)
    assert code == 200
    got = said(headers["X-Persist-Explain"])
    assert got == {"reason": "empty", "shared": "0", "usable": "0", "cached": "0"}
    body = json.loads(raw)
    ext = body["persist"]["explain"]
    assert ext["reason"] == "empty" and ext["message"] == REASONS["empty"]
    assert ext["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert ext["cached_tokens"] == 0
    log = Path(server.log.name).read_text()
    assert f"persist: explain: reason=empty prompt={ext['prompt_tokens']} cached=0" in log


def test_a_returning_chat_is_told_hit(server: Server) -> None:
    chat(server, TURN1, {})
    code, headers, raw = chat(server, TURN2, ASK)
    got = said(headers["X-Persist-Explain"])
    body = json.loads(raw)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert code == 200 and got["reason"] == "hit" and int(got["cached"]) == cached > 0
    assert body["persist"]["explain"]["shared_tokens"] == int(got["shared"]) >= cached


def test_a_stream_gets_its_verdict_in_the_headers(server: Server) -> None:
    code, headers, raw = chat(server, asking("A streamed question"), ASK, stream=True)
    assert code == 200 and said(headers["X-Persist-Explain"])["reason"] in REASONS
    assert raw.rstrip().endswith(b"data: [DONE]") and b'"persist"' not in raw


def test_a_stream_served_alone_waits_for_its_lookup(server: Server) -> None:
    """A request with a seed is served alone: mlx-lm hands its handler the stream
    before the lookup has run, so the header waits for it."""
    chat(server, asking("Seeded, first"), {})
    code, headers, _ = chat(server, asking("Seeded, second"), ASK, stream=True, seed=7)
    got = said(headers["X-Persist-Explain"])
    assert code == 200 and got["reason"] == "hit" and int(got["cached"]) > 16


def test_without_the_header_nothing_is_added(server: Server) -> None:
    code, headers, raw = chat(server, asking("Nobody asked why"), {})
    assert code == 200 and "X-Persist-Explain" not in headers
    assert "persist" not in json.loads(raw)


def test_a_header_that_is_neither_yes_nor_no_is_a_400(server: Server) -> None:
    code, _, raw = chat(server, asking("Maybe?"), {"X-Persist-Explain": "maybe"})
    assert code == 400
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and "X-Persist-Explain" in err["message"]


def counted_misses(srv: Server, before: dict[str, float], wait: float = 60.0) -> dict[str, float]:
    """The misses once one more is counted (a verdict nobody asked for is judged on
    the writer thread, a moment after the answer; bounded)."""
    deadline = time.monotonic() + wait
    while sum((now := misses(srv)).values()) <= sum(before.values()):
        assert time.monotonic() < deadline, "the miss was never counted"
        time.sleep(0.05)
    return now


def explain_steps(srv: Server) -> float:
    """Judgements the generation thread ran (its ``explain`` step's count)."""
    key = ("persist_generation_thread_seconds_count", (("step", "explain"),))
    return metrics(srv).get(key, 0.0)


def test_misses_are_counted_by_reason_every_label_there(server: Server) -> None:
    before = misses(server)
    assert set(before) == set(REASONS) - {"hit"}
    written(server)  # nothing queued or in writing: the verdict may go behind the saves
    on_thread = explain_steps(server)
    cold = [{"role": "user", "content": "Zebras, quartz and a jukebox: " * 8}]
    chat(server, cold, {})  # nothing stored shares a token with it
    after = counted_misses(server, before)
    # judged off the generation thread: a miss nobody asked about costs it nothing
    assert explain_steps(server) == on_thread
    assert after["empty"] == before["empty"] + 1
    assert {r: v for r, v in after.items() if r != "empty"} == {
        r: v for r, v in before.items() if r != "empty"
    }


def test_another_setup_s_entries_are_named_by_their_fields(model_dir: Any, tmp_path: Path) -> None:
    model, store = model_dir("llama_hd64"), tmp_path / "store"  # group size 32 fits
    kv = ("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0")
    first = persist_serve(model, store, tmp_path / "a.log", *kv)
    try:
        assert chat(first, TURN1, {})[0] == 200
    finally:
        first.stop()  # its entries are in the store
    plain = persist_serve(model, store, tmp_path / "b.log")
    try:
        before = misses(plain)
        code, headers, raw = chat(plain, TURN1, ASK)
        after = misses(plain)
    finally:
        plain.stop()
    got = said(headers["X-Persist-Explain"])
    assert code == 200 and got["reason"] == "identity" and got["cached"] == "0"
    assert int(got["shared"]) > 0 and got["usable"] == "0"
    ext = json.loads(raw)["persist"]["explain"]
    assert "cache_config.kv_bits" in ext["identity_fields"]
    assert after["identity"] == before["identity"] + 1


def test_a_tenant_is_told_nothing_of_another_tenant_s_prompts(
    model_dir: Any, tmp_path: Path
) -> None:
    keys = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef"}
    (tmp_path / "keys").write_text("".join(f"{k} {t}\n" for t, k in keys.items()))
    srv = persist_serve(
        model_dir("llama"),
        tmp_path / "store",
        tmp_path / "s.log",
        "--api-keys",
        str(tmp_path / "keys"),
    )
    auth = {t: {"Authorization": f"Bearer {k}", **ASK} for t, k in keys.items()}
    try:
        assert chat(srv, TURN1, auth["alice"])[0] == 200
        own = chat(srv, TURN1, auth["alice"])  # alice's own: she shares it
        code, headers, raw = chat(srv, TURN1, auth["bob"])  # bob sends alice's very prompt
    finally:
        srv.stop()
    assert int(said(own[1]["X-Persist-Explain"])["shared"]) > 0
    got = said(headers["X-Persist-Explain"])
    assert code == 200 and got == {"reason": "empty", "shared": "0", "usable": "0", "cached": "0"}
    ext = json.loads(raw)["persist"]["explain"]
    assert set(ext) == {"reason", "message", "prompt_tokens", "cached_tokens", "shared_tokens",
                        "usable_tokens"}  # fmt: skip
