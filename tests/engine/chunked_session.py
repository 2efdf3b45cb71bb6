"""A chunked-attention session whose front mlx-lm dropped (issue 36 repros 1 and 2),
and the oracle its hits are held to: shared by tests/engine/test_chunked_front.py
and tests/serve/test_chunked_memory.py.

A llama4 model (``attention_chunk_size`` 32) fed 60 tokens in one call, then
20 single decode steps: ``ChunkedKVCache.maybe_trim_front`` keeps only the
last 32 positions of each chunked layer (``start_position`` 47), saved at 80.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import persist
from tests.helpers import NEXT, assert_same_state, live_state, raw, tokens_for

GIB = 1 << 30
FIRST = 60  # the first call's tokens; the rest are single decode steps
SAVED = 80


def feed(model: Any, toks: Sequence[int], first: int = FIRST) -> list[Any]:
    """A fresh cache fed ``toks`` as the session was: one call of ``first``, then singles."""
    cache = make_prompt_cache(model)
    head = list(toks[:first])
    if head:
        model(mx.array([head]), cache=cache)
        mx.eval([c.state for c in cache])
    for t in toks[first:]:
        model(mx.array([[t]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def continues_alike(model: Any, got: list[Any], want: list[Any], steps: int = 6) -> None:
    """Both caches, fed the same tokens one at a time, give the same logits and hold
    the same state after every step (what mlx-lm's next front drop leaves included)."""
    for i, t in enumerate([*NEXT, *tokens_for(steps, seed=77)][:steps]):
        a = model(mx.array([[t]]), cache=got)[0, -1]
        b = model(mx.array([[t]]), cache=want)[0, -1]
        mx.eval(a, b)
        assert raw(a) == raw(b), f"logits differ at step {i}"
        assert_same_state(live_state(got), live_state(want))


def session(tiny: Any) -> tuple[Any, Any, persist.ModelIdentity, list[int], list[Any]]:
    model, tok, _ = tiny("llama4")
    ident = persist.ModelIdentity.of(model, tok)
    toks = [ord(c) for c in "The quick brown fox jumps over the lazy dog; " * 2][:SAVED]
    cache = feed(model, toks)
    starts = {int(c.start_position) for c in cache if hasattr(c, "start_position")}
    assert starts == {47}  # the premise: mlx-lm dropped the front of every chunked layer
    return model, tok, ident, toks, cache


def prompt_sharing(toks: list[int], h: int) -> list[int]:
    return [*toks[:h], (toks[h] + 1) % 256 if h < len(toks) else 33, 34]


def check_hit(model: Any, hit: Any, toks: list[int], h: int) -> None:
    if hit is None:
        return
    k = len(hit.tokens)
    assert k <= h and hit.tokens == toks[:k]
    continues_alike(model, hit.cache, feed(model, toks[:k]))
