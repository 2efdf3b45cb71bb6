"""``persist serve --host-cache``: a conversation mlx-lm's prompt cache evicted is
served from the host-RAM tier, not the store, and answers as a fresh prefill does."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import persist
from bench.servers import Server

from .test_serve import TURN1, TURN2, cached, text

OTHER = [
    {"role": "system", "content": "You answer questions about gardening. " * 8},
    {"role": "user", "content": "When should I plant tulips?"},
]


def scrape(srv: Server, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}{path}", timeout=60) as r:
        return bytes(r.read())


def metrics(srv: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(scrape(srv, "/metrics").decode())
        for s in fam.samples
    }


def lookups(m: dict[Any, float], source: str) -> float:
    key = ("persist_cache_lookups_total", (("result", "hit"), ("source", source)))
    return m.get(key, 0.0)


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
    assert lookups(after, "host") - lookups(before, "host") == 1
    assert lookups(after, "local") == lookups(before, "local")  # the store was not read
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
