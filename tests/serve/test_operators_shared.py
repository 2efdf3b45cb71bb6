"""What /metrics and /health say about a shared tier: two ``persist serve`` processes
(two "machines", two stores) and one real redis-server, which is then stopped."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from tests.serve.servers import TURN1, TURN2, get, hits, metrics, written
from tests.tiers.conftest import RedisServer


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def serve(model: Path, store: Path, shared: str, log: Path) -> Server:
    args = ["persist", "serve", "--model", str(model), "--store", str(store)]
    return Server([*args, "--shared", shared], log)


def test_shared_hits_bytes_and_the_breaker(model_dir: Any, redis: Any, tmp_path: Path) -> None:
    model = model_dir("llama")
    a = serve(model, tmp_path / "a", redis.url, tmp_path / "a.log")
    b = serve(model, tmp_path / "b", redis.url, tmp_path / "b.log")
    try:
        a.chat(TURN1)
        r = redis.client()
        deadline = time.monotonic() + 60  # the write-behind pushes after the answer
        while not r.keys("persist:*:rec:*") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics(a)[("persist_tier_written_bytes_total", (("tier", "shared"),))] > 0
        before = metrics(b)
        b.chat(TURN2)  # b's store is empty: the conversation comes from the tier
        after = metrics(b)
        assert hits(after, "shared") == hits(before, "shared") + 1
        assert hits(after, "local") == hits(before, "local")
        assert after[("persist_tier_read_bytes_total", (("tier", "shared"),))] > 0
        assert after[("persist_tier_up", (("tier", "shared"),))] == 1
        assert json.loads(get(b, "/health")[1])["tiers"] == {"shared": "up"}
        redis.stop()
        other = [{"role": "user", "content": "Something else entirely, please. " * 10}]
        b.chat(other)  # served without the tier, which its breaker now skips
        code, body = get(b, "/health")
        health = json.loads(body)
        assert code == 200 and health["status"] == "degraded", health
        assert health["tiers"] == {"shared": "down"}
        assert metrics(b)[("persist_tier_up", (("tier", "shared"),))] == 0
    finally:
        a.stop()
        b.stop()


def test_a_tier_that_refuses_is_told_on_metrics_the_log_and_the_stop_line(
    model_dir: Any, redis: Any, tmp_path: Path
) -> None:
    """Redis out of memory under its default policy (noeviction) refuses every push:
    no breaker opens (the server answers), so the log, /metrics and the stop line
    must say so (found from outside: all three were silent)."""
    r = redis.client()
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 4096))
    log = tmp_path / "a.log"
    a = serve(model_dir("llama"), tmp_path / "a", redis.url, log)
    try:
        a.chat(TURN1)
        written(a)
        got = metrics(a)
        assert got[("persist_tier_refusals_total", (("tier", "shared"),))] > 0
        assert got[("persist_tier_up", (("tier", "shared"),))] == 1  # answered: no breaker
    finally:
        a.stop()
    text = log.read_text()
    assert "refused" in text and "maxmemory" in text
    assert "refused by the shared tier" in text
