"""Restore and lookup: which stored row to read, what to do when it changes or is damaged.

The Store's ``restore`` and ``lookup`` are thin wrappers over these.  Rows
and blocks come from the index (``persist.storage``), bytes from the blob
tier through ``loading.load_snapshot``; counters are kept here, once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack

from ..errors import CorruptBlobError, IdentityMismatchError, SessionNotFoundError
from ..identity import ModelIdentity, backend_kind
from ..marks import mark_unverified
from ..records import Progress
from ..storage import lookup as lookup_queries
from ..storage.chains import chain_root, chains
from ..storage.full import best_effort
from .costs import LOCAL, CostModel, local_hit
from .layer_checks import quantized_start
from .loading import load_snapshot
from .skips import skipped_damaged
from .unverified import marked

if TYPE_CHECKING:
    from ..storage.blobs import BlobStore
    from ..storage.index import BlockRef, Index, SnapshotRow

__all__ = [
    "restore_named",
    "read_named",
    "row_gone",
    "index_hit",
    "lookup_prefix",
    "RESTORE_RETRIES",
]

T = TypeVar("T")

log = logging.getLogger("persist")
RESTORE_RETRIES = 4  # re-reads of a session that concurrent saves keep replacing


def saved_identity(row: SnapshotRow) -> ModelIdentity:
    return ModelIdentity.from_dict(msgpack.unpackb(row.identity_map, raw=False))


def restore_named(
    index: Index,
    blobs: BlobStore,
    namespace: str,
    session: str,
    *,
    identity: ModelIdentity,
    progress: Progress | None = None,
    strict_backend: bool = False,
    costs: CostModel | None = None,
) -> tuple[list[Any], SnapshotRow]:
    """The named session's caches and row, exactly as saved.

    The row and its blocks are read together, and again where the session was
    saved again meanwhile (``read_named``).
    """

    def read(row: SnapshotRow, refs: list[BlockRef]) -> list[Any]:
        if row.identity != identity.digest:
            saved_identity(row).require_same(identity, f"session {session!r}")
        if strict_backend and _other_backend(row, identity):
            saved = saved_identity(row)
            raise IdentityMismatchError(
                f"session {session!r}", ["backend"], saved.display(), identity.display()
            )
        tier, nbytes = (LOCAL, 0) if costs is None else local_hit(index, blobs, row, None)
        with _timed(costs, identity, tier, nbytes):
            return load_snapshot(index, blobs, row, progress, refs=refs)

    cache, row = read_named(index, namespace, session, read)
    if marked(row.metadata):  # what continues it stays unverified, under any name
        mark_unverified(cache)
    # statistics: a full disk drops them, never the restore (store.full)
    best_effort(index.touch, row.id)
    best_effort(index.count, namespace, restores=1, restored_tokens=row.n_tokens)
    return cache, row


def read_named(
    index: Index,
    namespace: str,
    session: str,
    read: Callable[[SnapshotRow, list[BlockRef]], T],
) -> tuple[T, SnapshotRow]:
    """``read`` of the named session's row and blocks, read in one transaction.

    If a blob of it is gone because the session was saved again or removed
    meanwhile (its old blobs collected), the new version is read instead, or
    SessionNotFoundError; a blob missing from a row that did not change is
    damage (CorruptBlobError).  ``restore`` and ``export`` read by this."""
    last_id = None
    for _attempt in range(RESTORE_RETRIES):
        found = index.by_name_with_blocks(namespace, session)
        if found is None:
            raise SessionNotFoundError(session, namespace)
        row, refs = found
        try:
            return read(row, refs), row
        except CorruptBlobError:
            # damage, unless a newer save replaced the row meanwhile
            if row.id == last_id or not row_gone(index, row):
                raise
            last_id = row.id
    raise CorruptBlobError(f"session {session!r}", "kept changing while it was read")


def row_gone(index: Index, row: SnapshotRow) -> bool:
    """Has ``row`` left the index since it was read (a concurrent gc, check --fix, rm or
    save removed it)?  Then what its read found missing or not matching is that
    delete, not damage.  Read again in a transaction of its own: the row as it is
    now, compared by checksum, since a new row may take a freed id."""
    now = index.get(row.id)
    return now is None or now.row_xxh3 != row.row_xxh3


def _timed(costs: CostModel | None, identity: ModelIdentity, tier: str, nbytes: int) -> Any:
    """Time a local restore into the cost model under the rate it took (from the
    page cache or the disk; a no-op without a model)."""
    if costs is None:
        return contextlib.nullcontext()
    return costs.timing_restore(identity, tier, nbytes)


def _other_backend(row: SnapshotRow, identity: ModelIdentity) -> bool:
    saved, here = backend_kind(saved_identity(row).backend), backend_kind(identity.backend)
    return bool(saved and here and saved != here)


def index_hit(
    index: Index,
    toks: list[int],
    identity: ModelIdentity,
    *,
    namespace: str,
    block_tokens: int,
    skip: set[int],
) -> tuple[SnapshotRow, int] | None:
    """The row and usable prefix a lookup restores, from the index alone (no blob read)."""
    secret = index.secret(namespace)  # a lookup never creates a namespace
    if secret is None:
        return None
    chs = chains(chain_root(secret, identity.digest), toks, block_tokens)
    return lookup_queries.best_row(
        index,
        namespace,
        identity.digest,
        chains=chs,
        toks=toks,
        block=block_tokens,
        skip=skip,
        quantized_start=quantized_start(identity),  # rows plain past it serve no cut there
    )


def lookup_prefix(
    index: Index,
    blobs: BlobStore,
    toks: list[int],
    *,
    identity: ModelIdentity,
    namespace: str,
    block_tokens: int,
    longer_than: int = 0,
    strict_backend: bool = False,
    costs: CostModel | None = None,
    max_cost: float | None = None,
    count_miss: bool = True,
    held: int | None = None,
) -> tuple[list[Any], SnapshotRow, int] | None:
    """(caches cut to the prefix, row, prefix) of the best usable hit, or None.

    A damaged snapshot is skipped (and counted) and the next best is tried.
    A hit of at most ``longer_than`` tokens is not read and not counted, nor is
    a miss without ``count_miss`` (the host tier serves that lookup).
    With ``costs``, a hit predicted to restore slower than a prefill of its
    tokens past ``held`` (what the caller holds in memory; None: ``longer_than``),
    or than ``max_cost`` seconds, is declined: None, as a miss.
    """
    held = longer_than if held is None else held
    skip: set[int] = set()
    while (
        found := index_hit(
            index, toks, identity, namespace=namespace, block_tokens=block_tokens, skip=skip
        )
    ) is not None:
        row, prefix = found
        if strict_backend and _other_backend(row, identity):
            skip.add(row.id)  # computed on another backend: not for a strict store
            continue
        if prefix <= longer_than:
            return None
        tier, nbytes = LOCAL, 0
        if costs is not None:
            tier, nbytes = local_hit(index, blobs, row, prefix)
            d = costs.decide(identity, namespace, [(tier, nbytes)], prefix, max_cost, held)
            if not d.restore:
                return None  # recomputing is faster here: counted as cost_recomputed
        try:
            with _timed(costs, identity, tier, nbytes):
                cache = load_snapshot(index, blobs, row, keep=prefix)
        except CorruptBlobError as e:
            skip.add(row.id)
            if row_gone(index, row):  # evicted or replaced by another process meanwhile
                log.debug("persist: a lookup's snapshot %d went while it was read", row.id)
                continue
            log.warning("persist: skipping a damaged snapshot in lookup: %s", e)
            best_effort(index.count, namespace, corrupt_skipped=1)
            skipped_damaged()  # the verdict of persist serve says so
            continue
        best_effort(index.touch, row.id)
        best_effort(index.count, namespace, hits=1, restored_tokens=prefix)
        return cache, row, prefix
    if count_miss:
        best_effort(index.count, namespace, misses=1)
    return None
