"""Retention queries: what a budget evicts and which entries a new one replaces.  No mlx.

Run inside the caller's write transaction (``db``), so what they find is
what the same transaction removes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import policy
from ..errors import InvalidArgumentError
from . import keys, writes
from .blobs import BlobStore
from .index import Index
from .rows import SnapshotRow, entry_info
from .types import GcReport, Rollback

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "Budgets",
    "anonymous_prefixes_of",
    "lru_victim",
    "hinted_rows",
    "evict_lru",
    "collect",
    "gc",
]


@dataclass(frozen=True)
class Budgets:
    """Byte budgets: the whole store's, and optionally one per namespace.

    ``per_namespace`` is bytes for every namespace or a map of namespace to
    bytes; with it a save evicts only entries of its own namespace.
    """

    max_bytes: int | None = None
    per_namespace: int | Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 0):
            raise InvalidArgumentError(f"max_bytes must be bytes >= 0, got {self.max_bytes!r}")
        b = self.per_namespace
        values = b.values() if isinstance(b, Mapping) else [b]
        if b is not None and any(type(v) is not int or v < 0 for v in values):
            raise InvalidArgumentError("namespace_max_bytes must be bytes >= 0 (or a map of them)")

    def of(self, namespace: str) -> int | None:
        """The budget of ``namespace`` alone (None: only the store's)."""
        b = self.per_namespace
        return b.get(namespace) if isinstance(b, Mapping) else b

    def limits(self, namespace: str) -> list[tuple[int, str | None]]:
        """(budget, namespace or None for the whole store) pairs a save must meet."""
        both = ((self.max_bytes, None), (self.of(namespace), namespace))
        return [(b, ns) for b, ns in both if b is not None]

    def scope(self, namespace: str) -> str | None:
        """Where a save's victims come from: its own namespace once tenants have budgets."""
        return namespace if self.per_namespace is not None else None


def collect(index: Index, blobs: BlobStore) -> int:
    """Unlink blob files whose last reference was committed away; how many went."""
    dead = index.collect()
    for f in dead:
        blobs.delete(f)
    index.forget(dead)
    return len(dead)


def anonymous_prefixes_of(
    db: sqlite_utils.Database,
    namespace: str,
    identity: str,
    chains: Sequence[bytes],
    tokens: Sequence[int],
    block: int,
) -> list[SnapshotRow]:
    """Anonymous prefix entries whose tokens are a prefix of ``tokens`` (or all of
    them), found through the lookup keys: under each of the new snapshot's block
    boundaries, the tails that are a prefix of its next tokens.  O(its blocks x
    log entries), never a scan of the entries that merely share its blocks."""
    ids: list[int] = []
    for b in range(len(tokens) // block + 1):
        q = keys.sort_pack(tokens[b * block : (b + 1) * block])
        for trimmable in (True, False):
            for rest in keys.prefixes(db, chains[b], q, trimmable):
                ids += [
                    r[0]
                    for r in db.execute(
                        "SELECT t.snapshot FROM tails t CROSS JOIN snapshots s "
                        "ON s.id = t.snapshot WHERE t.anchor = ? AND t.trimmable = ? "
                        "AND t.rest = ? AND s.namespace = ? AND s.identity = ? "
                        "AND s.name IS NULL AND s.role = 'prefix'",
                        [chains[b], int(trimmable), rest, namespace, identity],
                    )
                ]
    return [r for sid in ids for r in Index.rows_where(db, "id = ?", [sid])]


def lru_victim(
    db: sqlite_utils.Database,
    namespace: str | None,
    protect: frozenset[int],
    now: float | None = None,
) -> int | None:
    """The next unpinned snapshot to evict (of ``namespace``), not in ``protect``.

    The SQL form of ``policy.eviction_key``: the least recently used entry
    without retention hints is one index seek, however many are pinned; the
    few hinted entries are ordered apart, and the lower key of the two wins.
    """
    now = time.time() if now is None else now
    where, args = "pinned = 0", list[Any]()
    if namespace is not None:
        where, args = "namespace = ? AND pinned = 0", [namespace]
    if protect:
        where += f" AND id NOT IN ({','.join('?' * len(protect))})"
        args += sorted(protect)
    # (pinned, used): the oldest unpinned entry is one seek, however many are pinned
    index = "snapshots_ns_lru" if namespace is not None else "snapshots_lru"
    plain = db.execute(
        f"SELECT id, used FROM snapshots INDEXED BY {index} WHERE {where}"
        " AND id NOT IN (SELECT snapshot FROM retention_hints) ORDER BY used, id LIMIT 1",
        args,
    ).fetchone()
    hinted = db.execute(
        "SELECT id, used, ttl, priority FROM retention_hints CROSS JOIN snapshots ON id = snapshot"
        f" WHERE {where} ORDER BY (ttl > 0 AND used + ttl > ?), priority, used, id LIMIT 1",
        [*args, now],
    ).fetchone()
    found = []
    if plain is not None:
        found.append(policy.eviction_key(policy.EvictEntry(plain[0], plain[1], False, ()), now))
    if hinted is not None:
        e = policy.EvictEntry(hinted[0], hinted[1], False, (), hinted[2], hinted[3])
        found.append(policy.eviction_key(e, now))
    return min(found)[3] if found else None


def hinted_rows(db: sqlite_utils.Database) -> dict[int, tuple[float, int]]:
    """Every snapshot's retention hints (ttl, priority), by id: few rows, read whole."""
    got = db.execute("SELECT snapshot, ttl, priority FROM retention_hints")
    return {int(r[0]): (float(r[1]), int(r[2])) for r in got}


def evict_lru(
    db: sqlite_utils.Database,
    index: Index,
    limits: Sequence[tuple[int, str | None]],
    scope: str | None,
    protect: frozenset[int] = frozenset(),
) -> tuple[list[SnapshotRow], tuple[int, int] | None]:
    """Remove least recently used unpinned snapshots until every (budget, namespace) holds.

    ``namespace`` None means the whole store's bytes; victims come from
    ``scope`` (None: any namespace), never from ``protect``.  Returns the
    removed rows and, if the victims ran out first, (bytes, budget) of the
    limit still exceeded (the caller decides: a save refuses, gc reports).  One victim at a time
    against the trigger-kept byte counters: the order of
    ``policy.plan_eviction``, without scanning every block.
    """
    removed: list[SnapshotRow] = []
    for budget, ns in limits:
        while (total := index.unique_bytes(db, ns)) > budget:
            victim = lru_victim(db, scope, protect)
            if victim is None:
                return removed, (total, budget)
            removed += Index.rows_where(db, "id = ?", [victim])
            writes.remove(db, victim)
    return removed, None


def gc(index: Index, blobs: BlobStore, budget: int | None, dry_run: bool) -> GcReport:
    """``Store.gc``: evict LRU snapshots down to ``budget`` (the rule a save applies),
    then delete unreferenced blob files; a dry run reports and changes nothing."""
    before = index.unique_bytes()
    victims = []
    try:
        with index.write() as db:
            if budget is not None:
                rows, _ = evict_lru(db, index, [(budget, None)], None)
                victims = [entry_info(r) for r in rows]
            if dry_run:
                after = index.unique_bytes(db)
                raise Rollback(GcReport(victims, 0, before - after, after, True))
    except Rollback as r:
        return r.report
    deleted = collect(index, blobs)
    after = index.unique_bytes()
    return GcReport(victims, deleted, before - after, after, False)
