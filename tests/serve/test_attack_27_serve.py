"""Attacks on ``persist serve --host-cache`` and the server's host tier (issue 27 item 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from bench.servers import Server
from persist.engine.host.tier import HostTier
from persist.serve.server import PersistentPromptCache
from tests.helpers import prefill, tokens_for

from .test_serve import TURN1, cached, text
from .test_serve_host_cache import OTHER, lookups, metrics


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
    assert answer(two) == answer(want2), (cached(two), lookups(after, "host"))
    assert answer(again) == answer(first)
    assert lookups(after, "host") >= lookups(before, "host")


def test_a_shared_host_tier_keeps_tenants_apart(tiny: Any, tmp_path: Path) -> None:
    """Two tenants' prompt caches over one RAM budget (the README's library server)."""
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    a_toks, b_toks = tokens_for(60, seed=1), tokens_for(60, seed=2)
    host = HostTier(1 << 30)
    with persist.Store(tmp_path / "store") as store:
        a = PersistentPromptCache(1, store=store, identity=identity, namespace="a", host=host)
        b = PersistentPromptCache(1, store=store, identity=identity, namespace="b", host=host)
        try:
            a.insert_cache("m", a_toks, prefill(model, a_toks)[0])
            a.insert_cache("m", b_toks, prefill(model, b_toks)[0])  # a_toks evicted to RAM
            a.flush()
            assert store.lookup([*a_toks, 1], identity=identity, namespace="b") is None
            cache, rest = b.fetch_nearest_cache("m", [*a_toks, 1])
            # tenant b never sent these tokens: nothing of tenant a's may answer it
            assert cache is None and len(rest) == 61
        finally:
            a.close()
            b.close()
