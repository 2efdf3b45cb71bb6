"""Retention hints from ``persist serve`` requests (``cache_control``, the ``persist``
extension) reach the store's rows and the host tier, keep an agent's prefix through
a burst of one-off prompts that overflow the budget, and never let a tenant hold
more than its budget.  Real server processes, a real HTTP client, real stores."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import persist
from bench.servers import Server
from tests.helpers import prefill
from tests.serve.servers import hits, metrics, persist_serve, written

AGENT = "You are the order agent. Tools: lookup(order), refund(order). " * 12
MARK = {"type": "ephemeral", "ttl": "1h"}


def ask(srv: Server, messages: list[dict[str, Any]], **extra: Any) -> tuple[int, dict[str, Any]]:
    headers = extra.pop("headers", {})
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def agent_turn(question: str, hinted: bool) -> list[dict[str, Any]]:
    system: dict[str, Any] = {"role": "system", "content": AGENT}
    if hinted:
        system["cache_control"] = MARK
    return [system, {"role": "user", "content": question}]


def one_off(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"One-off document {i}: " + f"item {i} costs {i}. " * 45}]


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def row_bytes(tiny: Any, messages: list[dict[str, Any]], tmp: Path) -> int:
    """What a save of ``messages``' prompt (and two tokens more) costs in a store."""
    model, tok, _ = tiny("llama")
    toks = list(tok.apply_chat_template(messages, add_generation_prompt=True)) + [5, 6]
    with persist.Store(tmp / "probe") as probe:
        identity = persist.ModelIdentity.of(model, tok)
        return int(probe.save(prefill(model, toks)[0], toks, identity=identity).bytes)


def buffer_bytes(tiny: Any, messages: list[dict[str, Any]]) -> int:
    """What mlx-lm's cache of ``messages``' prompt holds in RAM: whole buffers, grown in
    steps (the host tier keeps a cache mlx-lm gives up as it is)."""
    model, tok, _ = tiny("llama")
    toks = list(tok.apply_chat_template(messages, add_generation_prompt=True)) + [5, 6]
    return sum(int(c.nbytes) for c in prefill(model, toks, step=len(toks))[0])


def hinted_rows(store: Path) -> list[tuple[int, float, int]]:
    with persist.Store(store) as s:
        got = s.index.db.execute(
            "SELECT n_tokens, ttl, priority FROM snapshots JOIN retention_hints ON id = snapshot"
        ).fetchall()
    return sorted((int(n), float(t), int(p)) for n, t, p in got)


def test_a_marked_system_prompt_and_the_extension_hint_the_saved_rows(
    model_dir: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    srv = persist_serve(model_dir("llama"), store, tmp_path / "s.log")
    try:
        code, _ = ask(srv, agent_turn("Where is order 7?", True), persist={"priority": 3})
        plain, _ = ask(srv, one_off(1))
    finally:
        srv.stop()  # the write-behind is flushed
    assert code == plain == 200
    rows = hinted_rows(store)
    assert rows and all((t, p) == (3600.0, 3) for _, t, p in rows)
    with persist.Store(store) as s:
        assert len(s.entries()) > len(rows)  # the one-off's entries carry none


def test_a_bad_hint_is_a_400_in_openai_s_shape(model_dir: Any, tmp_path: Path) -> None:
    srv = persist_serve(model_dir("llama"), tmp_path / "store", tmp_path / "s.log")
    try:
        bad = agent_turn("Where is order 7?", False)
        bad[0]["cache_control"] = {"type": "ephemeral", "ttl": "2h"}
        code, body = ask(srv, bad)
    finally:
        srv.stop()
    assert code == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"
    assert '"5m" or "1h"' in body["error"]["message"]


def burst(srv: Server, hinted: bool) -> tuple[int, int]:
    """The agent's first turn, five one-off prompts, the agent's next turn: (its
    cached tokens, the agent prompt's tokens up to its question).  Each cache is
    written before the next request: the write-behind gives way to back-to-back
    requests (serve.quiet), which would reorder the store's evictions."""
    code, first = ask(srv, agent_turn("Where is order 7?", hinted))
    assert code == 200
    written(srv)
    for i in range(5):
        assert ask(srv, one_off(i))[0] == 200
        written(srv)
    code, second = ask(srv, agent_turn("Refund order 9, please.", hinted))
    assert code == 200
    return cached(second), int(first["usage"]["prompt_tokens"])


@pytest.mark.parametrize("hinted", [True, False])
def test_the_agent_prefix_outlives_a_burst_that_overflows_the_store(
    hinted: bool, tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    agent = row_bytes(tiny, agent_turn("Where?", False), tmp_path)
    other = row_bytes(tiny, one_off(0), tmp_path / "b")
    budget = agent + other * 3 // 2  # the agent's entry and one one-off, not two
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "s.log",
        "--max-bytes", str(budget), "--host-cache", "0", "--prompt-cache-size", "1",
    )  # fmt: skip
    try:
        got, prompt = burst(srv, hinted)
        m = metrics(srv)
    finally:
        srv.stop()
    if hinted:  # its system prompt, read back from the store
        assert got > prompt // 2 and hits(m, "local") >= 1
    else:  # evicted first, as least recently used: prefilled again
        assert got < 16


@pytest.mark.parametrize("hinted", [True, False])
def test_the_host_tier_keeps_the_agent_prefix_through_the_burst(
    hinted: bool, tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    agent = buffer_bytes(tiny, agent_turn("Where?", False))
    host = agent + buffer_bytes(tiny, one_off(0)) * 3 // 2  # the agent's and one one-off
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "s.log",
        "--host-cache", str(host), "--prompt-cache-size", "1",
    )  # fmt: skip
    try:
        before = hits(metrics(srv), "host")
        got, prompt = burst(srv, hinted)
        after = metrics(srv)
    finally:
        srv.stop()
    assert got > prompt // 2  # the store has it either way
    assert (hits(after, "host") - before >= 1) == hinted, after


def test_hints_never_let_a_tenant_past_its_budget(
    tiny: Any, model_dir: Any, tmp_path: Path
) -> None:
    (tmp_path / "keys").write_text("alice-key-0123456789abcdef alice\n")
    budget = row_bytes(tiny, one_off(0), tmp_path) * 5 // 2
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "s.log",
        "--api-keys", str(tmp_path / "keys"), "--tenant-max-bytes", str(budget),
    )  # fmt: skip
    auth = {"Authorization": "Bearer alice-key-0123456789abcdef"}
    try:
        for i in range(5):  # each pinned: the strongest hint there is
            code, _ = ask(srv, one_off(i), headers=auth, persist={"pin": True})
            assert code == 200
    finally:
        srv.stop()
    with persist.Store(tmp_path / "store") as s:
        (ns,) = {e.namespace for e in s.entries()}
        assert s.index.unique_bytes(namespace=ns) <= budget
        assert s.check() == []
    assert hinted_rows(tmp_path / "store")
    assert "could not persist" not in (tmp_path / "s.log").read_text()


def test_tenants_sharing_the_store_s_budget_get_no_hints(model_dir: Any, tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("alice-key-0123456789abcdef alice\n")
    srv = persist_serve(
        model_dir("llama"), tmp_path / "store", tmp_path / "s.log",
        "--api-keys", str(tmp_path / "keys"),
    )  # fmt: skip
    auth = {"Authorization": "Bearer alice-key-0123456789abcdef"}
    try:
        code, _ = ask(srv, agent_turn("Where?", True), headers=auth, persist={"priority": 9})
    finally:
        srv.stop()
    assert code == 200 and hinted_rows(tmp_path / "store") == []
    assert "retention hints in requests are ignored" in (tmp_path / "s.log").read_text()
