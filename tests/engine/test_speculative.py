"""Greedy speculative decoding on a hybrid target equals plain greedy decoding."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from persist.apps.speculative import speculative_greedy
from persist.caches import make_cache
from tests.helpers import tokens_for


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    cache = make_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        out.append(t)
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("num_draft", [1, 3])
@pytest.mark.parametrize("draft_variant", ["llama", "qwen3_next", "qwen3_next_b"])
def test_speculative_equals_greedy(num_draft: int, draft_variant: str, tiny: Any) -> None:
    target, _, _ = tiny("qwen3_next")
    draft, _, _ = tiny(draft_variant)  # a perfect draft (itself), poor ones, hybrid or not
    prompt = tokens_for(40, 8)
    want = greedy(target, prompt, 24)
    assert speculative_greedy(target, draft, prompt, 24, num_draft=num_draft) == want
