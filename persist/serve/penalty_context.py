"""Penalties on a cache hit look back over the cached tokens too.

mlx-lm's one-request path (a request with a ``seed``, every request under
``--kv-bits`` or a draft model) fetches a cache, then hands ``stream_generate``
only the uncached rest of the prompt; the penalties' logits processors (presence,
repetition, frequency: each looks back over the last N tokens) see what
generation was handed, so on a hit they missed the cached tokens and answered
other tokens than a fresh prefill (attack r17b).  mlx-lm's batched path hands
them every token already; its speculative decoding shows them none of the prompt
but its last token, hit or not, so there nothing changes.  Here the prompt cache
notes, on its thread, which cache a lookup handed out and the tokens it covers
(``note``), and mlx-lm's ``stream_generate`` given that cache has every processor
see those tokens first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["note", "patch", "LOOK_BACK"]

LOOK_BACK = 1 << 20  # cached tokens a processor is shown: request_checks.MAX_CONTEXT

_last = threading.local()  # (id of the cache a lookup handed out, the tokens it covers)


def note(cache: Any, covered: Sequence[int]) -> None:
    """The lookup on this thread handed out ``cache`` (None: none) covering ``covered``."""
    # a vision prompt's key holds an image's hash (a negative id) where its tokens were:
    # no ids to show, so such a hit keeps mlx-lm's own behaviour
    tokens = list(covered[-LOOK_BACK:])
    _last.seen = (id(cache), tokens) if cache is not None and min(tokens, default=0) >= 0 else None


def patch(server: Any) -> None:
    """mlx-lm's ``stream_generate`` (as its server calls it: keywords) with each logits
    processor shown the tokens the handed-out cache covers before the rest."""
    real = server.stream_generate

    def stream_generate(*args: Any, **kwargs: Any) -> Any:
        seen, _last.seen = getattr(_last, "seen", None), None
        processors = kwargs.get("logits_processors")
        cache = kwargs.get("prompt_cache")
        # speculative decoding shows its processors no prompt token but the last, fresh
        # or not: a hit is already what a fresh prefill is there
        spec = kwargs.get("draft_model") is not None
        if processors and not spec and seen is not None and seen[0] == id(cache) and seen[1]:
            import mlx.core as mx

            before = mx.array(seen[1])
            kwargs["logits_processors"] = [_after(before, p) for p in processors]
        return real(*args, **kwargs)

    server.stream_generate = stream_generate


def _after(before: Any, processor: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    import mlx.core as mx

    def seeing_all(tokens: Any, logits: Any) -> Any:
        if tokens is None:
            return processor(before, logits)
        return processor(mx.concatenate([before.astype(tokens.dtype), tokens]), logits)

    return seeing_all
