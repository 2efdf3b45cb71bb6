"""The parts of ``persist serve``'s operator edge, one at a time (no server process)."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import Any

import pytest

from persist.serve.http_edge import Deadlines
from persist.serve.logs import JsonFormatter, redact
from persist.serve.request_checks import BadRequest, check_request, parse_json

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path, body, param",
    [
        (TEXT, {"prompt": ["a"]}, "prompt"),
        (TEXT, {"prompt": ""}, "prompt"),
        (TEXT, {}, "prompt"),
        (TEXT, {"prompt": "a", "stop": [1]}, "stop"),
        (TEXT, {"prompt": "a", "stop": [""]}, "stop"),
        (TEXT, {"prompt": "a", "stop": ["x"] * 65}, "stop"),
        (TEXT, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        (TEXT, {"prompt": "a", "max_tokens": True}, "max_tokens"),
        (TEXT, {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
        (TEXT, {"prompt": "a", "max_completion_tokens": "9"}, "max_completion_tokens"),
        (TEXT, {"prompt": "a", "temperature": -1}, "temperature"),
        (TEXT, {"prompt": "a", "top_p": 2}, "top_p"),
        (TEXT, {"prompt": "a", "seed": -1}, "seed"),
        (TEXT, {"prompt": "a", "seed": 1 << 64}, "seed"),
        (TEXT, {"prompt": "a", "logprobs": 1}, "logprobs"),
        (TEXT, {"prompt": "a", "top_logprobs": 12}, "top_logprobs"),
        (TEXT, {"prompt": "a", "stream": "yes"}, "stream"),
        (TEXT, {"prompt": "a", "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),
        (TEXT, {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
        (TEXT, {"prompt": "a", "logit_bias": {"-3": 1}}, "logit_bias"),
        (TEXT, {"prompt": "a", "logit_bias": {"3": "1"}}, "logit_bias"),
        (TEXT, {"prompt": "a", "model": 5}, "model"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": ["hi"]}, "messages"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [5]}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
        (CHAT, {**OK_CHAT, "tools": "abc"}, "tools"),
        (CHAT, {**OK_CHAT, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
        (CHAT, {**OK_CHAT, "role_mapping": "x"}, "role_mapping"),
        (TEXT, {"prompt": "a", "xtc_threshold": 0.6}, "xtc_threshold"),
        (TEXT, {"prompt": "a", "xtc_probability": 1}, "xtc_probability"),
        (CHAT, {**OK_CHAT, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
         "messages"),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1]"}}]}]}, "messages"),
    ],
)  # fmt: skip
def test_each_bad_field_is_named(path: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as e:
        check_request(path, body)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)  # an InvalidArgumentError: a PersistError too
    assert e.value.body()["error"]["param"] == param


@pytest.mark.parametrize(
    "path, body",
    [
        (TEXT, {"prompt": "a", "max_tokens": 4, "stop": "x", "temperature": 0.5, "seed": 3}),
        (TEXT, {"prompt": "a", "logit_bias": {"3": -100}, "top_logprobs": -1, "logprobs": True}),
        (TEXT, {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}),
        (CHAT, {**OK_CHAT, "stop": ["a", "b"], "tools": [], "adapters": None}),
        (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]}),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"x": 1}'}}]}]}),
        (CHAT, {**OK_CHAT, "chat_template_kwargs": {"enable_thinking": False}}),
    ],
)  # fmt: skip
def test_what_mlx_lm_serves_passes(path: str, body: dict[str, Any]) -> None:
    check_request(path, body)


def test_image_parts_pass_for_a_model_that_takes_images() -> None:
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    check_request(CHAT, {"messages": [{"role": "user", "content": [part]}]}, images=True)


@pytest.mark.parametrize(
    "raw, says",
    [
        (b'{"prompt": NaN}', "NaN"),
        (b'{"temperature": Infinity}', "Infinity"),
        (b"[1]", "JSON object"),
        (b"\xff\xfe", "UTF-8"),
        (b"{", "not JSON"),
        (b'{"n": ' + b"1" * 5000 + b"}", "not JSON"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper"),
        (b'{"x": ' + b"[" * 65 + b"]" * 65 + b"}", "deeper"),
        (b'{"prompt": "\\ud800"}', "not Unicode"),
    ],
)
def test_bodies_that_are_not_json_objects(raw: bytes, says: str) -> None:
    with pytest.raises(BadRequest, match=says):
        parse_json(raw)


def test_the_reaper_answers_408_and_closes_a_stalled_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        deadlines = Deadlines(poll=0.01)
        try:
            late = deadlines.watch(conn, 0.0)
            kept = deadlines.watch(conn, 3600.0)
            client.settimeout(60)
            reply = b""
            while chunk := client.recv(4096):  # EOF: the server shut the connection
                reply += chunk
            assert reply.startswith(b"HTTP/1.0 408")
            assert not deadlines.done(late)  # the handler learns the reaper answered
            assert deadlines.done(kept)  # a connection claimed in time is the handler's
        finally:
            deadlines.close()
            client.close()
            conn.close()


def test_tier_urls_are_logged_without_passwords() -> None:
    assert redact("redis://:hunter2@cache.local:6379/0") == "redis://***@cache.local:6379/0"
    assert redact("rediss://user:pw@h/1") == "rediss://***@h/1"
    assert redact("s3://bucket/prefix") == "s3://bucket/prefix"
    assert redact(None) == "off"
    # found in round 5: a cluster URL with credentials raised ValueError at start, and a
    # password holding "/" was shown whole
    assert (
        redact("redis+cluster://u:pw@h1:7000,h2:7000/0") == "redis+cluster://***@h1:7000,h2:7000/0"
    )
    assert redact("redis://:p/w@h:1/0") == "redis://***@h:1/0"
    assert redact("redis://u:p@[::1]:6379/0") == "redis://***@[::1]:6379/0"


def test_json_log_lines() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        exc = sys.exc_info()
    record = logging.LogRecord("persist", logging.ERROR, __file__, 1, "a %s", ("b",), exc)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "a b" and line["level"] == "error" and line["logger"] == "persist"
    assert "ValueError: boom" in line["exc"] and line["ts"].endswith("Z")


def test_metrics_never_fail_a_save(tmp_path: Path) -> None:
    """A metric that cannot be read (a closed store) is skipped: the caller goes on."""
    import persist
    from persist.serve.metrics import ServeMetrics

    other = persist.Store(tmp_path / "other")
    m = ServeMetrics(other, "default")
    probe = m.probe(save=True)
    other.close()
    assert probe is not None
    m.saved(probe, True)  # reads the closed store's counters: no exception
    assert m.value("persist_writes_total", result="saved") == 1
    assert m.health()["store"]["reachable"] is False


@pytest.mark.parametrize("tier", ["local", "local-disk"])
def test_a_hit_from_the_disk_counts_as_local_reads(tier: str, tmp_path: Path) -> None:
    """Attack 27 (round 4): a store hit priced at the disk's rate ("local-disk")
    added nothing to persist_tier_read_bytes_total{tier="local"}."""
    from persist import Store
    from persist.policy.recompute import CostDecision
    from persist.serve.metrics import ServeMetrics

    with Store(tmp_path / "s") as store:
        m = ServeMetrics(store, "default")
        cost = CostDecision(
            tokens=600,
            nbytes=1_000_000,
            tier=tier,
            restore_s=0.01,
            prefill_s=0.1,
            restore=True,
            reason="faster",
        )
        probe = m.probe()
        assert probe is not None
        m.looked_up(probe, prompt=603, memory=0, hit=600, cost=cost)
        assert m.value("persist_tier_read_bytes_total", tier="local") == 1_000_000
