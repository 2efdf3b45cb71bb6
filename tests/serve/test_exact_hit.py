"""A prompt that is exactly what mlx-lm's memory tier holds (a client continuing its
own answer after ``max_tokens``: the previous prompt + its answer) is served, as a
hit one token short, on the batched path and the one-request path (a ``seed``).

Found from outside (attack r17b): mlx-lm's trie hands out an exact hit with nothing
left to prefill; its batch loop raised on the empty prompt outside any request's
error handling, every request it had picked up (another client's too) failed with
503, and after six in a minute the server stopped; on the one-request path each
was a 500.  The oracle is a fresh server given the same prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.servers import Server
from tests.serve.servers import post

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
# the bias makes the tiny random model answer ASCII that re-tokenizes to its own ids
ASK = {"temperature": 0, "max_tokens": 6, "logprobs": True, "logit_bias": {"65": 12.0}}


def serve(model: Path, store: Path, log: Path) -> Server:
    return Server(["persist", "serve", "--model", str(model), "--store", str(store)], log)


def logprobs(resp: dict[str, Any]) -> list[float]:
    return [c["logprob"] for c in resp["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("path", ["batched", "one request"])
def test_a_prompt_memory_holds_exactly_is_served(
    path: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from persist.apps.demo import make_model

    model = make_model(tmp_path_factory.mktemp("exact") / "m", "llama", dtype="float32", seed=0)
    extra = {"seed": 1} if path == "one request" else {}
    srv = serve(model, tmp_path / "a", tmp_path / "a.log")
    try:
        code, first = post(srv, "/v1/completions", {"prompt": PROMPT, **ASK, **extra})
        assert code == 200, first
        again = PROMPT + first["choices"][0]["text"]
        answers = []
        for _ in range(3):  # each an exact hit in memory: served every time
            code, resp = post(srv, "/v1/completions", {"prompt": again, **ASK, **extra})
            assert code == 200, resp
            answers.append(logprobs(resp))
        code, _ = post(srv, "/v1/completions", {"prompt": "still up?", "max_tokens": 1})
        assert code == 200 and srv.proc.poll() is None
    finally:
        srv.stop()
    fresh = serve(model, tmp_path / "b", tmp_path / "b.log")
    try:
        code, want = post(fresh, "/v1/completions", {"prompt": again, **ASK, **extra})
        assert code == 200, want
    finally:
        fresh.stop()
    assert answers == [logprobs(want)] * 3
