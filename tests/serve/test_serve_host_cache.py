"""``persist serve --host-cache``: a conversation mlx-lm's prompt cache evicted is
served from the host-RAM tier, not the store, and answers as a fresh prefill does;
hybrid and sliding-window caches too (cases from an attack on the host tier)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import persist
from bench.servers import Server
from tests.serve.servers import OTHER, TURN1, TURN2, cached, hits, metrics, scrape, text


@pytest.mark.long
def test_evicted_conversation_comes_from_the_host_tier(model_dir: Any, tmp_path: Path) -> None:
    model = model_dir("llama")
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:
        want = plain.chat(TURN2)
    finally:
        plain.stop()
    store = tmp_path / "store"
    args = ["persist", "serve", "--model", str(model), "--store", str(store)]
    srv = Server([*args, "--host-cache", "256M", "--prompt-cache-size", "1"], tmp_path / "s.log")
    try:
        one = srv.chat(TURN1)
        srv.chat(OTHER)  # mlx-lm keeps one cache: TURN1's is evicted to the host tier
        before = metrics(srv)
        got = srv.chat(TURN2)
        after = metrics(srv)
        health = json.loads(scrape(srv, "/health"))
    finally:
        srv.stop()
    assert hits(after, "host") - hits(before, "host") == 1
    assert hits(after, "local") == hits(before, "local")  # the store was not read
    read = ("persist_tier_read_bytes_total", (("tier", "local"),))
    assert after.get(read, 0.0) == before.get(read, 0.0)
    assert cached(got) >= one["usage"]["prompt_tokens"] - 8
    assert text(got) == text(want)  # the same answer as a fresh prefill
    host = health["host_cache"]
    assert host["budget_bytes"] == 256 << 20 and 0 < host["bytes"] <= host["budget_bytes"]
    gauge = ("persist_host_cache_bytes", ())
    assert after[gauge] == host["bytes"]
    with persist.Store(store) as s:  # the cost model learned the host tier's rate
        stats = s.stats()
        assert stats.counters["serve_host_hits"] == 1
        # its first copy, kept apart from the rate (a process's one-time costs)
        assert any(r["what"] == "restore-first" and r["key"] == "host" for r in stats.rates)


def fresh(model: Path, tmp: Path, name: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp / f"{name}.log")
    try:
        return plain.chat(messages, logprobs=True)
    finally:
        plain.stop()


def answer(resp: dict[str, Any]) -> tuple[str, list[float]]:
    lp = resp["choices"][0].get("logprobs") or {}
    return text(resp), [round(float(x), 4) for x in lp.get("token_logprobs", [])]


@pytest.mark.long
@pytest.mark.parametrize("variant", ["qwen3_next", "gemma3"])
def test_evicted_hybrid_and_ring_caches_answer_as_a_fresh_prefill(
    variant: str, model_dir: Any, tmp_path: Path
) -> None:
    model = model_dir(variant)
    first = fresh(model, tmp_path, "p1", TURN1)
    turn2 = [
        *TURN1,
        {"role": "assistant", "content": text(first)},
        {"role": "user", "content": "And section 1?"},
    ]
    want2 = fresh(model, tmp_path, "p2", turn2)
    args = ["persist", "serve", "--model", str(model), "--store", str(tmp_path / "store")]
    srv = Server([*args, "--host-cache", "64M", "--prompt-cache-size", "1"], tmp_path / "s.log")
    try:
        one = srv.chat(TURN1, logprobs=True)
        srv.chat(OTHER)  # TURN1's cache goes to the host tier
        before = metrics(srv)
        two = srv.chat(turn2, logprobs=True)
        srv.chat(OTHER)
        again = srv.chat(TURN1, logprobs=True)  # the very same prompt once more
        after = metrics(srv)
    finally:
        srv.stop()
    assert answer(one) == answer(first)
    assert answer(two) == answer(want2), (cached(two), hits(after, "host"))
    assert answer(again) == answer(first)
    assert hits(after, "host") >= hits(before, "host")
