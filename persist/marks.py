"""Marks a restored cache's layer objects carry: today, unverified tokens.

A session saved with unverified tokens (``engine.unverified``) is restored
by name only; what continues it must stay unverified wherever it is saved
next, under its own name or another.  A restore cannot see the next save's
name, so it marks the cache objects it hands out, and a save of any cache
whose layers carry the mark (or a ``capture`` of one) is unverified too.

The mark is an attribute of each layer object: it survives in-place updates
(a prefill, a generation), ``copy.deepcopy`` (mlx-lm's prompt cache copies on
every fetch) and pickling, as a continuation of those tokens should.  A
layer class that takes no attributes (``__slots__``) is held in a registry
of weak references by id instead.  Imports nothing of mlx.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["mark_unverified", "carries_unverified"]

_ATTR = "_persist_unverified_tokens"
_weak: dict[int, weakref.ref[Any]] = {}  # id -> layer, for layers without a __dict__
_lock = threading.Lock()


def mark_unverified(layers: Iterable[Any]) -> None:
    """Mark every layer object: what continues them continues unverified tokens."""
    for c in layers:
        try:
            setattr(c, _ATTR, True)
        except (AttributeError, TypeError):
            _remember(c)


def _remember(c: Any) -> None:
    key = id(c)

    def gone(ref: weakref.ref[Any]) -> None:
        with _lock:
            if _weak.get(key) is ref:  # not a later object that took the same id
                del _weak[key]

    try:
        ref = weakref.ref(c, gone)
    except TypeError:  # neither attributes nor weak references: cannot be marked
        return
    with _lock:
        _weak[key] = ref


def carries_unverified(layers: Iterable[Any]) -> bool:
    """Whether any layer object carries the mark (False for what is no list of layers:
    the save's own check refuses that with its typed error)."""
    if not isinstance(layers, Sequence):
        return False
    for c in layers:
        if getattr(c, _ATTR, False) is True:
            return True
        with _lock:
            ref = _weak.get(id(c))
        if ref is not None and ref() is c:
            return True
    return False
