"""Differential trim checks shared by the codec and identity tests: a prefix hit
must hold exactly what a fresh prefill of that prefix holds and continue like it,
bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import persist
from tests.helpers import NEXT, assert_same_state, continue_run, live_state, raw, tokens_for

__all__ = ["assert_continues_alike", "hit_equals_prefill", "diverging"]


def assert_continues_alike(model: Any, got: list[Any], want: list[Any], rest: list[int]) -> None:
    assert_same_state(live_state(got), live_state(want))
    la, ga = continue_run(model, got, rest + NEXT)
    lb, gb = continue_run(model, want, rest + NEXT)
    assert ga == gb
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert raw(x) == raw(y), f"logits differ at step {i}"


def hit_equals_prefill(
    store: persist.Store,
    model: Any,
    identity: persist.ModelIdentity,
    build: Callable[[list[int]], list[Any]],
    stored: list[int],
    prompt: list[int],
    expect: int,
) -> None:
    store.save(build(stored), stored, identity=identity)
    hit = store.lookup(prompt, identity=identity)
    assert hit is not None and len(hit.tokens) == expect, hit
    assert hit.tokens == prompt[:expect]
    assert_continues_alike(model, hit.cache, build(prompt[:expect]), prompt[expect:])


def diverging(n_shared: int, n_stored: int, n_prompt: int) -> tuple[list[int], list[int]]:
    stored = tokens_for(n_stored, seed=1)
    prompt = stored[:n_shared] + [(t + 1) % 256 for t in tokens_for(n_prompt - n_shared, seed=2)]
    if n_prompt > n_shared and n_stored > n_shared:
        prompt[n_shared] = (stored[n_shared] + 7) % 256  # the first token after the prefix differs
    return stored, prompt
