"""Which models mlx-lm's speculative decoding serves exactly.

After each round it trims the rejected draft tokens from every layer
(``trim_prompt_cache``), and when any layer cannot be trimmed it trims
nothing, silently: the rejected tokens stay in the cache and every later
token is computed on them.  A recurrent layer can never be trimmed (mlx-lm
then refuses every request: attack 39h); a ring (a sliding window,
``RotatingKVCache``) can only until it passes its window, so gemma3 with a
draft answered right for short prompts and wrong past the window (attack
r17b).  Both are refused, for the model and for the draft, at start and for
a request that names its own draft model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["draft_problem"]


def draft_problem(model: Any, draft: Any) -> str | None:
    """Why ``draft`` cannot serve beside ``model`` exactly, or None (no draft, or every
    layer of both stays trimmable whatever its length)."""
    if draft is None:
        return None
    from mlx_lm.models.cache import make_prompt_cache

    for which, m in (("model", model), ("draft model", draft)):
        for layer in _layers(make_prompt_cache(m)):
            if not layer.is_trimmable():
                return (
                    f"--draft-model needs a model whose prompt cache can be trimmed (mlx-lm's "
                    f"speculative decoding refuses every request otherwise); the {which}'s "
                    "cache has layers that cannot be (recurrent state): serve it without a "
                    "draft model"
                )
            if getattr(layer, "max_size", None) is not None:
                return (
                    f"--draft-model needs a model whose prompt cache can always be trimmed; "
                    f"the {which}'s has sliding-window layers ({type(layer).__name__}), which "
                    "cannot be once past their window, and mlx-lm's speculative decoding then "
                    "keeps rejected draft tokens (wrong answers): serve it without a draft model"
                )
    return None


def _layers(cache: list[Any]) -> list[Any]:
    """Every layer, those inside a CacheList too."""
    out: list[Any] = []
    for c in cache:
        inner = getattr(c, "caches", None)
        out.extend(_layers(list(inner)) if inner is not None else [c])
    return out
