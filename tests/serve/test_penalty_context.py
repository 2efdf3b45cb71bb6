"""``serve/penalty_context`` on its own: which calls of mlx-lm's ``stream_generate``
get processors that see the cached tokens first, and what they see."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mlx.core as mx

from persist.serve import penalty_context


def _patched() -> tuple[Any, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    server = SimpleNamespace(stream_generate=lambda *a, **k: calls.append(k))
    penalty_context.patch(server)
    return server, calls


def test_a_hits_processors_see_the_cached_tokens_first() -> None:
    server, calls = _patched()
    seen: list[list[int]] = []
    proc = lambda tokens, logits: seen.append(tokens.tolist()) or logits  # noqa: E731
    cache: list[Any] = []
    penalty_context.note(cache, [1, 2, 3])
    server.stream_generate(prompt_cache=cache, logits_processors=[proc])
    calls[-1]["logits_processors"][0](mx.array([7, 8], dtype=mx.uint32), mx.zeros((1, 4)))
    assert seen == [[1, 2, 3, 7, 8]]


def test_other_calls_are_left_as_they_are() -> None:
    server, calls = _patched()
    proc = lambda tokens, logits: logits  # noqa: E731
    cache: list[Any] = []
    cases = [
        ([1, 2], {"prompt_cache": [], "logits_processors": [proc]}),  # another cache
        ([1, 2], {"prompt_cache": cache, "logits_processors": [proc], "draft_model": object()}),
        ([1, -5, 3], {"prompt_cache": cache, "logits_processors": [proc]}),  # an image's id
        ([], {"prompt_cache": cache, "logits_processors": [proc]}),  # nothing cached
    ]
    for covered, kwargs in cases:
        penalty_context.note(cache, covered)
        server.stream_generate(**kwargs)
        assert calls[-1]["logits_processors"] == [proc], covered
    penalty_context.note(cache, [1, 2])
    server.stream_generate(prompt_cache=cache, logits_processors=[proc])
    server.stream_generate(prompt_cache=cache, logits_processors=[proc])  # noted once only
    assert calls[-2]["logits_processors"] != [proc] and calls[-1]["logits_processors"] == [proc]
