"""mlx-lm's in-memory prompt cache evicting under retention hints, within a namespace.

mlx-lm's ``LRUPromptCache`` evicts through its ``CacheOrder``: least recently
inserted first, taking turns between its cache types (assistant, user, system)
so no type crowds out the others.  ``HintedOrder`` keeps that choice of whose
entry goes (the namespace of mlx-lm's own victim: a tenant's hints never make
another tenant's entry go, as each tenant's budget bounds the store and the
host tier) and, among that namespace's entries, evicts in the store's order
(``policy.eviction_key``): entries whose ttl still runs last, lower priorities
first, mlx-lm's own victim first among equals, then the oldest.  Without hints
it is mlx-lm's order exactly.  A ttl runs from the entry's insert: mlx-lm does
not tell its cache of a hit, so only a new insert (a conversation's next turn)
renews it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from mlx_lm.models.cache import LRUPromptCache

from .hints import Hints

__all__ = ["HintedOrder"]

Entry = tuple[Any, list[int]]  # (mlx-lm's model key, tokens), as its CacheOrder holds them


class HintedOrder(LRUPromptCache.CacheOrder):
    """mlx-lm's ``CacheOrder``, its ``pop`` choosing by hints within the namespace of
    mlx-lm's own victim.  ``hints_of``: an entry's (ttl, priority) or None;
    ``namespace_of``: the namespace of a model key; ``clock``: seconds, for ttls."""

    def __init__(
        self,
        hints_of: Callable[[Any, list[int]], Hints | None],
        namespace_of: Callable[[Any], str],
        clock: Callable[[], float],
    ) -> None:
        super().__init__()
        self._hints_of, self._namespace_of, self._clock = hints_of, namespace_of, clock
        self._since: dict[tuple[Any, tuple[int, ...]], float] = {}  # each entry's insert

    def push(self, model: Any, tokens: list[int], cache_type: str = "assistant") -> None:
        super().push(model, tokens, cache_type)
        self._since[(model, tuple(tokens))] = self._clock()

    def remove(self, model: Any, tokens: list[int]) -> None:
        super().remove(model, tokens)
        self._since.pop((model, tuple(tokens)), None)

    def pop(self) -> Entry:
        first = self._lrus[self._mlx_lm_choice()][0]
        ns, now = self._namespace_of(first[0]), self._clock()
        best: tuple[tuple[bool, int, bool, float], str, int] | None = None
        for kind, lru in self._lrus.items():
            for i, entry in enumerate(lru):
                if self._namespace_of(entry[0]) != ns:
                    continue
                key = (*self._rank(entry, now), entry is not first, self._inserted(entry))
                if best is None or key < best[0]:
                    best = (key, kind, i)
        assert best is not None  # ``first`` is always a candidate
        _, kind, i = best
        entry = self._lrus[kind][i]
        del self._lrus[kind][i]
        self._since.pop((entry[0], tuple(entry[1])), None)
        return entry

    def _mlx_lm_choice(self) -> str:
        """The cache type whose oldest entry mlx-lm's own ``pop`` takes."""
        order = self._ordering
        for a, b in itertools.pairwise(order):
            if self._lrus[a] and len(self._lrus[a]) >= len(self._lrus[b]):
                return str(a)
        return str(order[-1])

    def _inserted(self, entry: Entry) -> float:
        return self._since.get((entry[0], tuple(entry[1])), 0.0)

    def _rank(self, entry: Entry, now: float) -> tuple[bool, int]:
        """(protected by a running ttl, priority): ``policy.eviction_key``'s first two."""
        hints = self._hints_of(*entry)
        if hints is None:
            return False, 0
        ttl, priority = hints
        return ttl > 0 and self._inserted(entry) + ttl > now, int(priority)
