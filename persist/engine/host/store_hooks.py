"""``persist.Store(root, host_cache=N)``: saves kept in RAM, asked before the index.

Every save and checkpoint that may serve lookups keeps a copy of its live
positions in a ``HostTier`` of N bytes (LRU), keyed by namespace, model
digest (and backend kind, for a strict store) and the saved tokens.  A
lookup asks it first and takes its hit unless the store holds a strictly
longer one.  What the tier serves is what the durable lookup would: the
same resume policy over the committed row's facts (trimmable, floor), the
same codec cut; an unverified save (``engine.unverified``: a floor above its
length) is never kept, so it never serves a lookup here either.

It is a cache of exact states keyed by tokens and identity, so a session
removed from the store (``delete``, ``gc``, eviction) may stay in it and
still serves correct hits; ``Store.close`` drops it.  ``restore`` by name
never asks it (a name's current version is the index's to say).
This module imports mlx: a Store loads it only when ``host_cache`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ...errors import InvalidStateError
from ...format.tokens import unpack_tokens
from ...identity import ModelIdentity, backend_kind
from ...storage import writes
from ...storage.chains import HEAD_TOKENS
from ...storage.full import best_effort
from ...storage.rows import listed_info
from ...storage.types import Restored
from ..costs import CostModel
from .tier import HOST, HostHit, HostTier

if TYPE_CHECKING:
    from ...codecs.snapshot import Snapshot
    from ...storage.index import Index, SnapshotRow
    from ...storage.types import EntryInfo

__all__ = ["owner", "keep_saved", "host_hit", "served", "from_host", "HOST"]

log = logging.getLogger("persist")


def owner(namespace: str, identity: ModelIdentity, strict_backend: bool) -> str:
    """The tier key's owner: lookups of another namespace, model (or, for a strict
    store, backend kind) never meet these entries."""
    kind = backend_kind(identity.backend) if strict_backend else ""
    return f"{namespace}\0{identity.digest}\0{kind}"


def keep_saved(
    host: HostTier,
    cache: Sequence[Any] | Snapshot,
    row: SnapshotRow,
    *,
    info: EntryInfo,
    who: str,
    index: Index,
) -> None:
    """After the commit: keep a copy of what ``row`` saved, with its retention hints,
    unless it never serves a lookup.  A failure here is logged, never raised: the
    save is durable already."""
    if row.min_resume > row.n_tokens:  # unverified tokens: no lookup may take it
        return
    try:
        with index.read() as db:
            hints = writes.hints_of(db, row.id)
        host.keep(
            who,
            unpack_tokens(row.tokens),
            cache,
            copy=True,  # the caller goes on updating its cache in place
            trimmable=bool(row.trimmable),
            min_resume=int(row.min_resume),
            sticky=row.role == "checkpoint",
            info=info,
            hints=hints,
        )
    except Exception as e:
        log.warning("persist: the host cache did not keep a save: %s", e)


def host_hit(
    host: HostTier | None,
    costs: CostModel,
    identity: ModelIdentity,
    *,
    namespace: str,
    who: str,
    toks: list[int],
    longer_than: int,
    max_cost: float | None,
) -> tuple[int, int]:
    """(tokens the host tier would serve, tokens it holds): (0, 0) for none; (0, n)
    when the cost model declines its copy of n tokens.

    As the durable lookup: no hit shorter than HEAD_TOKENS, none of at most
    ``longer_than`` tokens (a host miss, counted), none predicted slower than a
    prefill of its tokens past ``longer_than`` (the caller holds those), or than
    ``max_cost``.  A declined copy still bounds the durable read:
    the same entry from disk costs more than from RAM, so only a longer hit
    may be read (each hit faces its own decision)."""
    if host is None:
        return 0, 0
    n, nbytes = host.peek(who, toks)
    if n < HEAD_TOKENS or n <= longer_than:
        host.missed()
        return 0, 0
    d = costs.decide(identity, namespace, [(HOST, nbytes)], n, max_cost, longer_than)
    return (n if d.restore else 0), n


def served(
    host: HostTier,
    costs: CostModel,
    identity: ModelIdentity,
    *,
    who: str,
    toks: Sequence[int],
    longer_than: int,
) -> HostHit | None:
    """A host-tier hit longer than ``longer_than`` (a fresh copy), its copy time told
    to the cost model as tier ``host`` (``persist serve`` and the Store)."""
    hit = host.fetch(who, toks, longer_than=longer_than)
    if hit is not None:
        costs.restored(identity, HOST, hit.nbytes, hit.seconds)
    return hit


class StoreView(Protocol):
    """What ``from_host`` reads of a Store (a protocol: ``engine.store`` imports this
    module, so this one names no Store)."""

    @property
    def host(self) -> HostTier | None: ...
    @property
    def index(self) -> Any: ...
    @property
    def costs(self) -> CostModel: ...
    @property
    def blobs(self) -> Any: ...
    @property
    def block_tokens(self) -> int: ...
    @property
    def strict_backend(self) -> bool: ...


def from_host(
    store: StoreView,
    host: HostTier | None,
    toks: list[int],
    *,
    identity: ModelIdentity,
    namespace: str,
    who: str,
    longer_than: int,
    max_cost: float | None,
) -> Restored | None:
    """The host tier's hit (``engine.lookup_order``), counted (``host_hits``); if another
    thread's save evicted it since ``host_hit`` saw it, the store's own hit."""
    from ..reading import lookup_prefix

    i, costs = store.index, store.costs  # index: closed -> InvalidStateError
    if host is None:
        raise InvalidStateError("the store was closed during the lookup")
    hit = served(host, costs, identity, who=who, toks=toks, longer_than=longer_than)
    if hit is not None:
        best_effort(i.count, namespace, host_hits=1, restored_tokens=len(hit.tokens))
        return Restored(hit.cache, hit.tokens, hit.info, source=HOST)
    b, strict = store.block_tokens, store.strict_backend
    found = lookup_prefix(
        i,
        store.blobs,
        toks,
        identity=identity,
        namespace=namespace,
        block_tokens=b,
        longer_than=longer_than,
        strict_backend=strict,
        costs=costs,
        max_cost=max_cost,
    )
    if found is None:
        return None
    cache, row, prefix = found
    return Restored(cache, toks[:prefix], listed_info(row))
