"""Retention queries: what a budget evicts and which entries a new one replaces.  No mlx.

Run inside the caller's write transaction (``db``), so what they find is
what the same transaction removes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .index import MAX_VARIABLES, Index
from .rows import SnapshotRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["anonymous_ending_at", "lru_victim", "evict_lru"]


def anonymous_ending_at(
    db: sqlite_utils.Database, namespace: str, identity: str, ends: Sequence[bytes]
) -> list[SnapshotRow]:
    """Anonymous prefix entries whose last chain is one of ``ends`` (bounded queries)."""
    out = []
    for i in range(0, len(ends), MAX_VARIABLES):
        part = list(ends[i : i + MAX_VARIABLES])
        marks = ",".join("?" * len(part))
        out += Index.rows_where(
            db,
            f"last_chain IN ({marks}) AND namespace = ? AND identity = ? "
            "AND name IS NULL AND role = 'prefix'",
            [*part, namespace, identity],
        )
    return out


def lru_victim(
    db: sqlite_utils.Database, namespace: str | None, protect: frozenset[int]
) -> int | None:
    """The least recently used unpinned snapshot (of ``namespace``), not in ``protect``.

    The SQL form of ``policy.plan_eviction``'s order (used, then id).
    """
    where, args = "pinned = 0", list[Any]()
    if namespace is not None:
        where, args = "namespace = ? AND pinned = 0", [namespace]
    if protect:
        where += f" AND id NOT IN ({','.join('?' * len(protect))})"
        args += sorted(protect)
    index = "snapshots_ns_used" if namespace is not None else "snapshots_used"
    row = db.execute(
        f"SELECT id FROM snapshots INDEXED BY {index} WHERE {where} ORDER BY used, id LIMIT 1",
        args,
    ).fetchone()
    return None if row is None else int(row[0])


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
            Index.remove(db, victim)
    return removed, None
