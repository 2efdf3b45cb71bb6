"""A request with penalties (presence, repetition, frequency) answers on a cache hit
what a fresh server answers: the penalties look back over the cached tokens too.

Found from outside (attack r17b): mlx-lm's one-request path (a request with a
``seed``, every request under ``--kv-bits`` or a draft model) hands generation only
the uncached rest of the prompt, so a penalty's look-back missed the cached tokens
and a hit, from memory or from the store after a restart, answered other tokens
than a fresh prefill.  The oracle is a fresh server given the same request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from tests.serve.servers import post

BASE = "Some shared prefix text that repeats 0123456789 abcdefghij. " * 2
TURN2 = BASE + "abc"
PENALTIES = [
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.8, "repetition_context_size": 40},
    {"frequency_penalty": 2.0},
]


def serve(model: Path, store: Path, log: Path, *extra: str) -> Server:
    return Server(["persist", "serve", "--model", str(model), "--store", str(store), *extra], log)


def answer(model: Path, store: Path, path: str, body: dict[str, Any], *opts: str) -> Any:
    """``body``'s answer from a server on ``store``, started for it and stopped."""
    srv = serve(model, store, store.with_suffix(".log"), *opts)
    try:
        code, got = post(srv, path, body)
        assert code == 200, got
        return got
    finally:
        srv.stop()


def hit(model: Path, store: Path, path: str, first: Any, then: Any, *opts: str) -> Any:
    """``then``'s answer right after ``first`` on one server: a hit from memory."""
    srv = serve(model, store, store.with_suffix(".log"), *opts)
    try:
        post(srv, path, first)
        code, got = post(srv, path, then)
        assert code == 200 and got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        return got
    finally:
        srv.stop()


def ids(resp: dict[str, Any]) -> list[Any]:
    return [(c["id"], c["logprob"]) for c in resp["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: next(iter(p)))
def test_a_hit_with_penalties_answers_as_a_fresh_server(
    penalty: dict[str, Any], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from persist.apps.demo import make_model

    model = make_model(tmp_path_factory.mktemp("pen") / "m", "llama", dtype="float32", seed=0)
    body = {"temperature": 0, "max_tokens": 8, "logprobs": True, "seed": 1, **penalty}
    want = answer(model, tmp_path / "fresh", "/v1/completions", {**body, "prompt": TURN2})
    first, then = {**body, "prompt": BASE}, {**body, "prompt": TURN2}
    memory = hit(model, tmp_path / "s", "/v1/completions", first, then)
    again = serve(model, tmp_path / "s", tmp_path / "again.log")  # the store serves it
    try:
        code, stored = post(again, "/v1/completions", {**body, "prompt": TURN2})
        assert code == 200 and stored["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        again.stop()
    assert ids(memory) == ids(want)
    assert ids(stored) == ids(want)


def test_a_hit_with_penalties_and_a_draft_answers_as_a_fresh_server(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """mlx-lm's speculative decoding shows its penalties no prompt token but the last,
    fresh or not: a hit must not show them the cached ones either."""
    from persist.apps.demo import make_model

    root = tmp_path_factory.mktemp("pen_draft")
    model = make_model(root / "m", "llama", dtype="float32", seed=0)
    draft = ("--draft-model", str(make_model(root / "d", "llama", dtype="float32", seed=3)))
    body = {"temperature": 0, "max_tokens": 8, "logprobs": True, "presence_penalty": 2.0}
    want = answer(model, tmp_path / "fresh", "/v1/completions", {**body, "prompt": TURN2}, *draft)
    first, then = {**body, "prompt": BASE}, {**body, "prompt": TURN2}
    memory = hit(model, tmp_path / "s", "/v1/completions", first, then, *draft)
    assert ids(memory) == ids(want)


def test_a_hit_beside_a_public_prefix_answers_as_a_fresh_server(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Outside attack r17c: with a public prefix a request is looked up twice (its own
    namespace, then the public one); the second lookup's note of what it covered
    replaced the first's, so when the own hit was the one handed out its penalties
    missed the cached tokens again."""
    import json

    from persist.apps.demo import make_model

    model = make_model(tmp_path_factory.mktemp("pen_pub") / "m", "llama", dtype="float32", seed=0)
    public = "2222222222 HHHHHHHH 22 HH. Acme support agent: qwvk. " + "Answer briefly. " * 4
    other = public[: len(public) // 2] + "Completely different tail of another system prompt."
    listed = tmp_path / "public.json"
    listed.write_text(json.dumps([{"messages": [{"role": "system", "content": public}]}]))
    ask = {"temperature": 0, "max_tokens": 8, "logprobs": True, "seed": 3,
           "logit_bias": {"50": 4.0}, "frequency_penalty": 0.5,
           "frequency_context_size": 1000}  # fmt: skip
    first = {**ask, "messages": [{"role": "system", "content": other},
                                 {"role": "user", "content": "hello"}]}  # fmt: skip
    second = {**ask, "messages": [{"role": "system", "content": public},
                                  {"role": "user", "content": "where is my order"}]}  # fmt: skip
    opts = ("--public-prefix", str(listed))
    want = answer(model, tmp_path / "fresh", "/v1/chat/completions", second, *opts)
    got = hit(model, tmp_path / "s", "/v1/chat/completions", first, second, *opts)
    assert ids(got) == ids(want)
