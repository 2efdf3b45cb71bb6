"""The key a cache mlx-lm's server hands the prompt cache may be kept under.

mlx-lm's server keys every cache by the prompt and every token it generated.
Plain decoding has fed each of them (``generate_step`` computes the next
token before it yields one), but speculative decoding yields the verified
token before feeding it, so after ``--draft-model`` the model's layers, and
the draft's after a fully accepted round, often cover one position less
than the key.  Kept under that key, or trimmed from it to a shared prefix,
such a cache is a position short and the next turn answers differently.
Here every layer is cut to the shortest and the key to what they cover.

Handed out, a cache always leaves a token to feed (``one_short``): mlx-lm's trie
hands out an exact hit with nothing left to prefill, which its batch loop and
its one-request path both fail on (attack r17b).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..codecs import facts_of

__all__ = ["covered_key", "one_short"]


def covered_key(tokens: Sequence[int], cache: Sequence[Any]) -> list[int] | None:
    """``tokens`` cut to the positions every layer of ``cache`` holds, the longer
    layers trimmed in place to match; None when no key fits (a layer that covers
    more than the tokens, or cannot be cut to the shortest)."""
    offsets = [_offset(c) for c in cache]
    known = [o for o in offsets if o is not None]
    if all(o == len(tokens) for o in known):
        return list(tokens)  # also a purely recurrent list: nothing counts its positions
    cover = min(known)
    if max(known) > len(tokens) or None in offsets:
        return None  # a recurrent layer cannot be cut to ``cover``
    for c, o in zip(cache, offsets, strict=True):
        if o is not None and o > cover and not _cut(c, o - cover):
            return None
    return list(tokens[:cover])


def _offset(cache: Any) -> int | None:
    try:
        return facts_of(cache).offset
    except Exception:  # a class persist does not know: as mlx-lm counts it
        offset = getattr(cache, "offset", None)
        return offset if type(offset) is int else None


def _cut(cache: Any, n: int) -> bool:
    """mlx-lm's own trim (what its server's rewinds and prefix hits use)."""
    trimmable = getattr(cache, "is_trimmable", None)
    if not callable(trimmable) or not trimmable():
        return False
    return int(cache.trim(n)) == n


def one_short(cache: list[Any], tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
    """An exact hit of ``tokens`` cut back one token, and that token to feed; a miss
    (None, every token) where a layer cannot be cut (recurrent state, a ring past its
    window): the tiers behind memory keep one token to feed themselves."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if not can_trim_prompt_cache(cache):
        return None, list(tokens)
    trim_prompt_cache(cache, 1)
    return cache, list(tokens[-1:])
