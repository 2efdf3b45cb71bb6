"""The host tier's entries and the order it evicts them in: the store's order.

An entry is evicted by ``policy.eviction_key``, as a store row is: entries
whose retention hint lapsed (or that have none) first, lowest priority first,
least recently used first; entries a ttl still protects last, in the same
order.  Hints only order: a budget (the tier's, or one owner's) still evicts a
protected entry when nothing else is left, so a hint never lets an owner (a
tenant) hold more than its share.  Without any hint it is plain LRU, and the
tier keeps its O(1) eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import policy
from ...cuda.pinned_pool import Held
from ...records import Record

__all__ = ["Kept", "Key", "order", "victims", "EvictionWatch"]

Key = tuple[str, tuple[int, ...]]  # (owner, tokens)


@dataclass(kw_only=True)
class Kept:
    id: int
    records: list[Record]
    nbytes: int
    tokens: Any  # numpy int64: compared with a prompt in one pass
    trimmable: bool
    min_resume: int
    sticky: bool  # a checkpoint: kept even when a longer entry covers it
    info: Any
    used: int = 0  # use order (a counter): LRU among entries of equal hints
    held: Held | None = None  # with a holder: the arrays' bytes (records hold SLOT)
    touched: float = 0.0  # wall time of the last keep or hit: what a ttl counts from
    ttl: float = 0.0  # retention hints (policy.eviction_key); (0, 0): none
    priority: int = 0

    @property
    def hinted(self) -> bool:
        return self.ttl > 0 or self.priority != 0

    def hint(self, hints: tuple[float, int] | None) -> None:
        """Take the stronger of its hints and ``hints`` (an entry that stands in for
        another serves its prefix too, so it keeps that one's protection)."""
        got = policy.stronger_hints((self.ttl, self.priority), hints)
        self.ttl, self.priority = got if got is not None else (0.0, 0)


def order(kept: Kept, now: float) -> tuple[bool, int, float, int]:
    """``policy.eviction_key`` of an entry: its ttl counts from its last use in wall
    time; ties in that time fall back to the use order (the key's last element)."""
    e = policy.EvictEntry(kept.used, kept.touched, False, (), ttl=kept.ttl, priority=kept.priority)
    return policy.eviction_key(e, now)


def victims(entries: Mapping[Key, Kept], now: float, owner: str | None = None) -> Iterable[Key]:
    """Keys (of ``owner``, or any) in the order they are evicted, first to last.  The
    mapping is in use order already, so without hints that order is taken as it is."""
    keys = [k for k in entries if owner is None or k[0] == owner]
    if not any(entries[k].hinted for k in keys):
        return keys
    return sorted(keys, key=lambda k: order(entries[k], now))


class EvictionWatch:
    """mlx-lm's prompt trie, with every ``pop`` (an eviction) reported first.

    ``LRUPromptCache`` evicts through ``_trie.pop`` only (its ``insert_cache``
    and ``trim_to``); dropping the prefixes a longer trimmable cache covers
    goes through ``pop_prefixes``, which is no loss and is not reported.
    """

    def __init__(self, trie: Any, on_evict: Any) -> None:
        self._trie, self._on_evict = trie, on_evict

    def pop(self, model: Any, tokens: Any) -> Any:
        entry = self._trie.pop(model, tokens)
        self._on_evict(model, list(tokens), entry.prompt_cache)
        return entry

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trie, name)
