"""Warm start: a store's most valuable entries for one model, read into the host tier
before the first request needs them (``Store.warm``, ``persist serve --warm N``).

Value is the order eviction keeps entries in, reversed: pinned first, then
``policy.eviction_key`` from last to first (entries a ttl protects, higher
priorities, the most recently used), and the tier keeps their hints.  Entries
are read least valuable first so the host tier keeps the most valuable if they
do not all fit; no more is read than the tier's budget holds.  An entry that
fails its checks is skipped (and logged), never served.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .. import policy
from ..errors import CorruptBlobError
from ..format.tokens import unpack_tokens
from ..identity import ModelIdentity
from ..storage.blobs import BlobStore
from ..storage.index import Index
from ..storage.retention import hinted_rows
from ..storage.rows import SnapshotRow, listed_info
from .host.store_hooks import owner
from .host.tier import HostTier
from .loading import load_snapshot
from .reading import row_gone

__all__ = ["WarmReport", "warm", "warm_candidates"]

log = logging.getLogger("persist")


@dataclass(frozen=True)
class WarmReport:
    entries: int  # read into the host tier
    tokens: int
    bytes: int  # of the blobs read
    skipped: int  # damaged, or refused by the tier
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def warm_candidates(
    rows: list[SnapshotRow],
    identity: ModelIdentity,
    n: int,
    budget: int,
    hints: Mapping[int, tuple[float, int]] | None = None,
    now: float | None = None,
) -> list[SnapshotRow]:
    """The ``n`` most valuable rows of ``identity`` that fit ``budget`` bytes together,
    most valuable first (``hints``: retention hints by row id, at ``now``).  Rows no
    lookup may take (unverified tokens) are left out."""
    mine = [r for r in rows if r.identity == identity.digest and r.min_resume <= r.n_tokens]
    hints, now = hints or {}, time.time() if now is None else now

    def key(r: SnapshotRow) -> tuple[bool, tuple[bool, int, float, int]]:
        ttl, prio = hints.get(r.id, (0.0, 0))
        e = policy.EvictEntry(r.id, r.used, False, (), ttl=ttl, priority=prio)
        return r.pinned, policy.eviction_key(e, now)

    mine.sort(key=key, reverse=True)
    out: list[SnapshotRow] = []
    total = 0
    for r in mine:
        if len(out) == n:
            break
        if total + r.nbytes <= budget:
            out.append(r)
            total += r.nbytes
    return out


def warm(
    index: Index,
    blobs: BlobStore,
    host: HostTier,
    *,
    identity: ModelIdentity,
    n: int,
    namespace: str | None,
    strict_backend: bool,
) -> WarmReport:
    t0 = time.perf_counter()
    every = index.snapshots(namespace, named_only=False)
    with index.read() as db:
        hinted = hinted_rows(db)
    rows = warm_candidates(every, identity, n, host.max_bytes, hinted)
    kept = tokens = nbytes = skipped = 0
    for row in reversed(rows):  # the most valuable last: the most recently kept
        try:
            cache = load_snapshot(index, blobs, row)
        except CorruptBlobError as e:
            if not row_gone(index, row):  # one removed or replaced meanwhile is not damage
                log.warning("persist: warm start skipped a damaged entry: %s", e)
            skipped += 1
            continue
        who = owner(row.namespace, identity, strict_backend)
        # a copy of the live positions: the tier counts those, as the budget does,
        # not the step-rounded capacity a restore allocates
        ok = host.keep(
            who, unpack_tokens(row.tokens), cache, copy=True, trimmable=bool(row.trimmable),
            min_resume=int(row.min_resume), sticky=row.role == "checkpoint",
            info=listed_info(row), hints=hinted.get(row.id),
        )  # fmt: skip
        if not ok:
            skipped += 1
            continue
        kept, tokens, nbytes = kept + 1, tokens + row.n_tokens, nbytes + row.nbytes
    return WarmReport(kept, tokens, nbytes, skipped, time.perf_counter() - t0)
