"""``persist serve``: a real server process on 127.0.0.1 and a real HTTP client."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

import persist
from bench.servers import Server
from tests.serve.servers import TURN1, TURN2, cached, persist_serve, text


@pytest.mark.long
@pytest.mark.parametrize("variant", ["llama", "qwen3_next", "gemma3"])
def test_restart_keeps_the_prompt_cache(variant: str, model_dir: Any, tmp_path: Path) -> None:
    model = model_dir(variant)
    plain = Server(["mlx_lm.server", "--model", str(model)], tmp_path / "plain.log")
    try:
        want = plain.chat(TURN2)
    finally:
        plain.stop()
    store = tmp_path / "store"
    first = persist_serve(model, store, tmp_path / "a.log")
    try:
        one = first.chat(TURN1)
    finally:
        first.stop()  # SIGTERM: the write-behind queue is flushed
    assert cached(one) == 0
    second = persist_serve(model, store, tmp_path / "b.log")
    try:
        got = second.chat(TURN2)
    finally:
        second.stop()
    # the earlier conversation (system prompt and first question) came from the store
    assert cached(got) >= one["usage"]["prompt_tokens"] - 8
    assert text(got) == text(want)
    with persist.Store(store) as s:
        assert s.check() == []
        stats = s.stats()
        assert stats.counters["serve_store_hits"] == 1
        # the server measured its prefills (each process's first kept apart: one-time
        # costs), and its store hit was a decision
        assert any(r["what"] == "prefill-first" for r in stats.rates)
        assert stats.decisions and stats.decisions[0]["restore"] is True


def test_sigkill_during_write_behind(model_dir: Any, tmp_path: Path) -> None:
    model = model_dir("llama")
    store = tmp_path / "store"
    srv = persist_serve(model, store, tmp_path / "a.log")
    try:
        srv.chat(TURN1)
        deadline = time.time() + 60
        while time.time() < deadline:  # wait until the first turn is durable
            with persist.Store(store) as s:
                if s.entries():
                    break
            time.sleep(0.2)
        srv.chat(
            [
                *TURN1,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "something else " * 30},
            ]
        )
    finally:
        srv.stop(signal.SIGKILL)  # likely while writing the second turn behind
    with persist.Store(store) as s:
        problems = s.check(fix=True)
        assert {p.kind for p in problems} <= {"orphan-tmp", "orphan-blob", "stale-pending"}, (
            problems
        )
        assert s.check() == []
    again = persist_serve(model, store, tmp_path / "b.log")
    try:
        assert cached(again.chat(TURN2)) > 0
    finally:
        again.stop()
