"""Which entry a full host tier lets go: one LRU for all, or tenants' shares.

Without shares (a Store's tier) the least recently used entry goes.  With
``persist serve --tenant-max-bytes`` every tenant has a share of the tier:
a keep first evicts the keeping tenant's own least recently used entries
down to its share (its salts and models together, as the store counts
them: ``storage.retention.budget_owner``); if the tier is still full, the
entries of whoever holds most go, least recently used first, the keeper's
own on a tie.  So a burst can push another tenant down to the keeper's own
holding, never below it, however old that tenant's entries.  Pure: no mlx.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...storage.retention import budget_owner

__all__ = ["Shares", "tenant_of"]

Key = tuple[str, tuple[int, ...]]  # a tier entry's key: (owner, tokens)


def tenant_of(owner: str) -> str:
    """An owner's tenant: its namespace's budget owner (an owner begins with its
    namespace: ``store_hooks.owner``)."""
    return budget_owner(owner.split("\0", 1)[0])


class Shares:
    """Bytes each tenant holds in a tier, and the next entry to evict.  The tier holds
    its lock around every call."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def add(self, owner: str, n: int) -> None:
        t = tenant_of(owner)
        self.held[t] = self.held.get(t, 0) + n

    def remove(self, owner: str, n: int) -> None:
        t = tenant_of(owner)
        left = self.held.get(t, 0) - n
        if left > 0:
            self.held[t] = left
        else:
            self.held.pop(t, None)

    def fits(self, owner: str, n: int, share: int) -> bool:
        return self.held.get(tenant_of(owner), 0) + n <= share

    def victim(
        self, keys: Iterable[Key], owner: str, n: int, over: bool, share: int | None
    ) -> Key | None:
        """The entry to evict (``keys`` least recently used first) before ``owner``
        keeps ``n`` bytes, ``over`` when the tier lacks room for them, under a
        tenant's ``share`` (None: one LRU for all); None when nothing need (or may) go."""
        keeper = tenant_of(owner)
        if share is not None and self.held.get(keeper, 0) + n > share:
            return _first_of(keys, keeper)  # its own, down to its share
        if not over:
            return None
        if share is None:
            return next(iter(keys), None)
        sizes = {**self.held, keeper: self.held.get(keeper, 0) + n}
        most = max(sizes, key=lambda t: (sizes[t], t == keeper))
        return _first_of(keys, most)  # None: the keeper holds most and has nothing older


def _first_of(keys: Iterable[Key], tenant: str) -> Key | None:
    return next((k for k in keys if tenant_of(k[0]) == tenant), None)
