"""Greedy speculative decoding for hybrid models, on caches that keep the contract.

A draft model proposes ``num_draft`` tokens; the target verifies them in one
forward.  On a rejection the target's attention layers trim and its
gated-DeltaNet layers (``GatedDeltaCache``) roll back and replay the accepted
positions, so the output is exactly the target's greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ..caches.gated_delta import GatedDeltaCache, make_cache
from ..errors import InvalidArgumentError, UnsupportedCacheError

__all__ = ["speculative_greedy"]


def _step(model: Any, cache: list[Any], toks: Sequence[int]) -> mx.array:
    logits = model(mx.array([list(toks)]), cache=cache)[0]
    mx.eval(logits)
    return logits


def _argmax(logits: mx.array) -> list[int]:
    ids: Any = mx.argmax(logits, axis=-1).tolist()
    return [int(t) for t in ids]


def _recurrent_states(cache: list[Any]) -> list[Any]:
    """The state of every GatedDeltaCache (None elsewhere): cheap, arrays are immutable."""
    return [(list(c.cache), c.offsets) if isinstance(c, GatedDeltaCache) else None for c in cache]


def _rewind_draft(cache: list[Any], states: list[Any], fed: int, keep: int) -> None:
    """Make the draft cover only the first ``keep`` of the ``fed`` tokens it saw."""
    for c, state in zip(cache, states, strict=True):
        if state is not None:
            c.cache, c.offsets = list(state[0]), state[1]
        elif keep < fed:
            c.trim(fed - keep)


def _resolve(cache: list[Any], window: int, keep: int) -> None:
    """Keep the first ``keep`` of the last ``window`` positions in every layer."""
    for c in cache:
        if isinstance(c, GatedDeltaCache):
            c.spec_round_rollback(keep) if keep < window else c.spec_round_commit()
        elif keep < window:
            if not c.is_trimmable():
                raise UnsupportedCacheError(f"{type(c).__name__} can neither trim nor roll back")
            c.trim(window - keep)


def speculative_greedy(
    model: Any, draft: Any, prompt: Sequence[int], max_tokens: int, *, num_draft: int = 3
) -> list[int]:
    """The target's greedy continuation of ``prompt``, computed speculatively."""
    if len(prompt) < 1 or num_draft < 1:
        raise InvalidArgumentError("need a prompt and num_draft >= 1")
    target_cache, draft_cache = make_cache(model), make_cache(draft)
    if len(prompt) > 1:
        _step(model, target_cache, prompt[:-1])
        _step(draft, draft_cache, prompt[:-1])
    y, out = int(prompt[-1]), list[int]()
    while len(out) < max_tokens:
        proposal: list[int] = []
        states: list[list[Any]] = []  # the draft's recurrent state after each token fed
        feed = y
        for _ in range(num_draft):  # the draft covers y and all but its last proposal
            feed = _argmax(_step(draft, draft_cache, [feed]))[-1]
            states.append(_recurrent_states(draft_cache))
            proposal.append(feed)
        for c in target_cache:
            if isinstance(c, GatedDeltaCache):
                c.spec_round_begin()
        verdict = _argmax(_step(model, target_cache, [y, *proposal]))
        n = 0
        while n < num_draft and proposal[n] == verdict[n]:
            n += 1
        _resolve(target_cache, num_draft + 1, n + 1)  # covers y and the n accepted
        if n < num_draft:
            _rewind_draft(draft_cache, states[n], num_draft, n + 1)
        else:
            _step(draft, draft_cache, [proposal[-1]])
        out += [*proposal[:n], verdict[n]]
        y = verdict[n]
    return out[:max_tokens]
