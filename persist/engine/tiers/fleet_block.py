"""One block size per fleet: a store refuses a shared tier that cuts another.

Prefix lookups find a fleet's snapshots by the chain hashes of whole blocks
(``storage/chains``), so machines with different ``block_tokens`` (16 and
256) never find each other's prefixes: every lookup missed, and nothing said
so.  The tier records each namespace's block size when a store first saves
to it (``RedisTier.block_tokens``: SET NX, then read back), and a store whose
``block_tokens`` differs gets ``BlockSizeMismatchError`` from every
operation on that namespace's tier, before anything is written.  The cold
tier (S3) records none: it serves named sessions.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Protocol

from ...errors import BlockSizeMismatchError
from ...remote.redis_tier import RedisTier, TierUnavailable
from ...storage.index import Index

__all__ = ["require_same_block"]


class Tiered(Protocol):
    """What this needs of ``exchange.Shared`` (not imported: it imports this)."""

    tier: Any


ASK_AGAIN_S = 10.0  # a namespace with no block size on the tier is asked again after this

# shared tier -> namespace -> when to ask again (inf: agreed for this process)
_asked: weakref.WeakKeyDictionary[Tiered, dict[str, float]] = weakref.WeakKeyDictionary()


def require_same_block(shared: Tiered, index: Index, namespace: str, create: bool) -> None:
    """BlockSizeMismatchError when the tier holds ``namespace`` in blocks of another
    size than this store's; ``create`` (a save) records this store's where the tier
    has none.  A tier that is down is the caller's to handle (nothing is known)."""
    tier = shared.tier
    if not isinstance(tier, RedisTier):
        return
    asked = _asked.setdefault(shared, {})
    if tier.clock() < asked.get(namespace, -math.inf) and not create:
        return
    if asked.get(namespace) == math.inf:
        return
    mine = store_block(index)
    try:
        theirs = tier.block_tokens(namespace, mine, create)
    except TierUnavailable:
        return
    if theirs is None:
        asked[namespace] = tier.clock() + ASK_AGAIN_S
        return
    if theirs == mine:
        asked[namespace] = math.inf
        return
    raise BlockSizeMismatchError(
        theirs,
        mine,
        f"the shared tier {tier.url} holds namespace {namespace!r} in blocks of {theirs} "
        f"tokens and this store cuts blocks of {mine}: their prefix lookups would never "
        f"find each other's snapshots. A fleet shares one block size (block_tokens, set "
        f"when a store is created: Store(root, block_tokens={theirs})); use a store made "
        "with the tier's, or another tier or namespace",
    )


def store_block(index: Index) -> int:
    """The block size this store was created with (its index's meta)."""
    with index.read() as db:
        return int(db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()[0])
