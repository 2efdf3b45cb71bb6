"""Retention queries: what a budget evicts and which entries a new one replaces.  No mlx.

Run inside the caller's write transaction (``db``), so what they find is
what the same transaction removes.
"""

from __future__ import annotations

import logging
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
    "PARTITION",
    "budget_owner",
    "owned_bytes",
    "owned_namespaces",
    "anonymous_prefixes_of",
    "lru_victim",
    "UNPUSHED",
    "unpushed_count",
    "over_budget",
    "hinted_rows",
    "evict_lru",
    "collect",
    "collect_measured",
    "gc",
]


log = logging.getLogger("persist")

PARTITION = "/salt:"  # NS/salt:X is a partition of NS (persist serve: a cache_salt)

# A named session whose latest version no tier holds: with tiers configured, budget
# eviction keeps it (its only copy: a push held back or failed during an outage).
# ``tier_seen`` records each version this store pushed or pulled (or a tombstone it
# saw): the row is on a tier once a version of its name no older than it is there,
# or this very version went under a fork name (``NAME~N``, same save time).  A new
# save is always newer than every version seen (``writes.version_after``).
UNPUSHED = (
    "(snapshots.name IS NOT NULL AND snapshots.role = 'session' AND NOT EXISTS ("
    "SELECT 1 FROM tier_seen t WHERE t.namespace = snapshots.namespace AND ("
    "(t.name = snapshots.name AND t.created >= snapshots.created) OR "
    "(t.name >= snapshots.name || '~0' AND t.name < snapshots.name || '~:' "
    "AND t.created = snapshots.created))))"
)


def budget_owner(namespace: str) -> str:
    """The namespace whose budget ``namespace`` counts against: its own, or for a
    partition (``NS/salt:X``) NS's, so a tenant's salts share one budget."""
    return namespace.split(PARTITION, 1)[0]


@dataclass(frozen=True)
class Budgets:
    """Byte budgets: the whole store's, and optionally one per namespace.

    ``per_namespace`` is bytes for every namespace or a map of namespace to
    bytes; with it a save evicts only entries of its own namespace.  A
    namespace's partitions (``budget_owner``) are within its budget, and a
    map names the owners only.
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
        """The budget ``namespace`` shares with its owner's other partitions (None: only
        the store's)."""
        b = self.per_namespace
        return b.get(budget_owner(namespace)) if isinstance(b, Mapping) else b

    def limits(self, namespace: str) -> list[tuple[int, str | None]]:
        """(budget, budget owner or None for the whole store) pairs a save must meet."""
        both = ((self.max_bytes, None), (self.of(namespace), budget_owner(namespace)))
        return [(b, ns) for b, ns in both if b is not None]

    def scope(self, namespace: str) -> str | None:
        """Where a save's victims come from: its budget owner's namespaces (its own and
        their partitions) once tenants have budgets; None: any namespace."""
        return budget_owner(namespace) if self.per_namespace is not None else None


def _owned(owner: str) -> tuple[str, list[str]]:
    """SQL over ``namespace``: the owner's namespace and its partitions (one key range)."""
    lo = owner + PARTITION
    hi = lo[:-1] + chr(ord(lo[-1]) + 1)  # the first string past every "NS/salt:..."
    return "(namespace = ? OR (namespace >= ? AND namespace < ?))", [owner, lo, hi]


def owned_bytes(db: sqlite_utils.Database, owner: str) -> int:
    """Live bytes of a budget owner's namespaces (the trigger-kept sums: no scan of blobs)."""
    where, args = _owned(owner)
    row = db.execute(f"SELECT COALESCE(SUM(bytes), 0) FROM usage WHERE {where}", args).fetchone()
    return int(row[0])


def owned_namespaces(db: sqlite_utils.Database, owner: str) -> list[str]:
    """The owner's namespaces holding bytes (a range of ``usage``'s key)."""
    where, args = _owned(owner)
    return [
        r[0] for r in db.execute(f"SELECT namespace FROM usage WHERE {where} AND bytes > 0", args)
    ]


def collect(index: Index, blobs: BlobStore) -> int:
    """Unlink blob files whose last reference was committed away; how many went."""
    return collect_measured(index, blobs)[0]


def collect_measured(index: Index, blobs: BlobStore) -> tuple[int, int]:
    """``collect``: how many blob files went, and their bytes."""
    dead = index.collect_sized()
    for f, _ in dead:
        blobs.delete(f)
    index.forget([f for f, _ in dead])
    return len(dead), sum(size for _, size in dead)


def anonymous_prefixes_of(
    db: sqlite_utils.Database,
    namespace: str,
    identity: str,
    *,
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
    owner: str | None,
    protect: frozenset[int],
    now: float | None = None,
    keep_unpushed: bool = False,
) -> int | None:
    """The next unpinned snapshot to evict (of ``owner``'s namespaces, ``budget_owner``;
    None: of any), not in ``protect`` (nor, with ``keep_unpushed``, ``UNPUSHED``): the
    lowest ``policy.eviction_key`` of each namespace's own, one index seek each (a
    tenant's salts are few seeks, never a scan of its entries)."""
    now = time.time() if now is None else now
    spaces: list[str | None] = [None] if owner is None else [*owned_namespaces(db, owner)]
    found = [k for ns in spaces for k in _first_keys(db, ns, protect, now, keep_unpushed)]
    return min(found)[3] if found else None


def _first_keys(
    db: sqlite_utils.Database,
    namespace: str | None,
    protect: frozenset[int],
    now: float,
    keep_unpushed: bool = False,
) -> list[tuple[Any, ...]]:
    """The eviction keys of ``namespace``'s first victims (None: the store's).

    The SQL form of ``policy.eviction_key``: the least recently used entry
    without retention hints is one index seek, however many are pinned; the
    few hinted entries are ordered apart, and the lower key of the two wins.
    """
    where, args = "pinned = 0", list[Any]()
    if namespace is not None:
        where, args = "namespace = ? AND pinned = 0", [namespace]
    if protect:
        where += f" AND id NOT IN ({','.join('?' * len(protect))})"
        args += sorted(protect)
    if keep_unpushed:  # skipped in the LRU order: only the unpushed at its head cost
        where += f" AND NOT {UNPUSHED}"
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
        e = policy.EvictEntry(hinted[0], hinted[1], False, (), ttl=hinted[2], priority=hinted[3])
        found.append(policy.eviction_key(e, now))
    return found


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
    keep_unpushed: bool = False,
) -> tuple[list[SnapshotRow], tuple[int, int] | None]:
    """Remove least recently used unpinned snapshots until every (budget, owner) holds.

    ``owner`` None means the whole store's bytes, else a budget owner's
    namespaces (``owned_bytes``); victims come from ``scope`` (a budget owner;
    None: any namespace), never from ``protect``.  Returns the
    removed rows and, if the victims ran out first, (bytes, budget) of the
    limit still exceeded (the caller decides: a save refuses, gc reports).  One victim at a time
    against the trigger-kept byte counters: the order of
    ``policy.plan_eviction``, without scanning every block.
    """
    removed: list[SnapshotRow] = []
    for budget, ns in limits:
        while (total := _held(db, index, ns)) > budget:
            victim = lru_victim(db, scope, protect, keep_unpushed=keep_unpushed)
            if victim is None:
                return removed, (total, budget)
            removed += Index.rows_where(db, "id = ?", [victim])
            writes.remove(db, victim)
    return removed, None


def unpushed_count(db: sqlite_utils.Database, protect: frozenset[int] = frozenset()) -> int:
    """Named sessions no tier holds yet (``UNPUSHED``), less ``protect`` (a save's own)."""
    sql = f"SELECT id FROM snapshots WHERE pinned = 0 AND {UNPUSHED}"
    return sum(1 for (sid,) in db.execute(sql) if sid not in protect)


def over_budget(total: int, budget: int, unpushed: int) -> str:
    """StoreFullError's message for a budget the victims ran out before."""
    said = f"the save would leave the store at {total} bytes, over its budget of {budget} bytes"
    if unpushed:
        said += (
            f"; it keeps {unpushed} named session{'s' if unpushed != 1 else ''} not yet on a "
            "tier (a push held back or failed: their only copy) until persist sync "
            "pushes them"
        )
    return said + "; nothing was saved"


def _held(db: sqlite_utils.Database, index: Index, owner: str | None) -> int:
    return index.unique_bytes(db) if owner is None else owned_bytes(db, owner)


def gc(
    index: Index, blobs: BlobStore, budget: int | None, dry_run: bool, keep_unpushed: bool = False
) -> GcReport:
    """``Store.gc``: evict LRU snapshots down to ``budget`` (the rule a save applies),
    then delete unreferenced blob files; a dry run reports and changes nothing.
    ``keep_unpushed``: named sessions no tier holds yet stay, counted in the report
    when they keep the store over ``budget``.

    Freed is what was deleted: the blob files' bytes (a dry run: the bytes its
    evictions leave unreferenced, in the one transaction).  The store's bytes before
    less its bytes after went negative when another writer saved in between."""
    victims, kept = [], 0
    try:
        with index.write() as db:
            before = index.unique_bytes(db)
            if budget is not None:
                rows, over = evict_lru(
                    db, index, [(budget, None)], None, keep_unpushed=keep_unpushed
                )
                victims = [entry_info(r) for r in rows]
                kept = unpushed_count(db) if over is not None and keep_unpushed else 0
            if dry_run:
                after = index.unique_bytes(db)
                raise Rollback(
                    GcReport(victims, 0, before - after, after, True, unpushed_kept=kept)
                )
    except Rollback as r:
        return r.report
    if kept:
        log.warning(
            "persist: gc kept %d named session(s) not yet on a tier (their only copy) over "
            "the budget of %d bytes; persist sync pushes them", kept, budget,
        )  # fmt: skip
    deleted, freed = collect_measured(index, blobs)
    return GcReport(victims, deleted, freed, index.unique_bytes(), False, unpushed_kept=kept)
