"""The one place that decides where a prompt's prefix comes from, and in what order.

    memory (the caller's own: ``longer_than``)  ->  host RAM  ->  the fleet's
    tiers (pulled into the index)  ->  the local index  ->  host RAM's copy

``Store.lookup`` runs it for library users; ``persist serve``'s prompt cache runs
it through ``Store.lookup`` after mlx-lm's memory, handing over its host tier.
Each later source must beat the longest prefix found so far, and nothing is
asked once that prefix leaves only the last token.  The host tier is only
peeked at first (its length and the cost model's verdict); its copy is made
last, and only if no durable source holds a strictly longer prefix: a copy
that loses is never made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..identity import ModelIdentity
from ..storage.rows import listed_info
from ..storage.types import Restored

if TYPE_CHECKING:
    from .costs import CostModel
    from .host.tier import HostTier

__all__ = ["nearest"]


def nearest(
    store: Any,
    toks: list[int],
    *,
    identity: ModelIdentity,
    namespace: str,
    longer_than: int,
    max_cost: float | None,
    host: HostTier | None,
    tiers: Sequence[Any],
) -> Restored | None:
    """The longest usable prefix of ``toks`` longer than ``longer_than``, or None.

    ``store``: what the reads need (``index``, ``blobs``, ``costs``,
    ``block_tokens``, ``strict_backend``: a Store)."""
    from .reading import lookup_prefix

    i, b, strict = store.index, store.block_tokens, store.strict_backend
    costs: CostModel = store.costs
    who, ram, kept = "", 0, 0
    taken = None  # the host copy's decision, where it is the one acted on
    if host is not None:
        from .host.store_hooks import host_hit, owner

        who = owner(namespace, identity, strict)
        ram, kept = host_hit(
            host,
            costs,
            identity,
            namespace=namespace,
            who=who,
            toks=toks,
            longer_than=longer_than,
            max_cost=max_cost,
        )
        taken = costs.last if ram else None
    have = max(kept, longer_than)  # what a pull or a read must beat (a declined copy too)
    # what a durable hit saves: a prefill past the host copy taken, else past memory's
    held = ram or longer_than
    if kept < len(toks) - 1:  # nothing beats a hit of every token but the last
        # the fleet's deepest snapshot, if it beats what is here (a read-only store
        # pulls nothing: a pull writes)
        for tier in tiers if not store.read_only else ():
            tier.pull_prefix(
                i,
                store.blobs,
                toks,
                identity=identity,
                namespace=namespace,
                block=b,
                costs=costs,
                max_cost=max_cost,
                longer_than=have,
                held=held,
            )
        found = lookup_prefix(
            i,
            store.blobs,
            toks,
            identity=identity,
            namespace=namespace,
            block_tokens=b,
            longer_than=have,
            strict_backend=strict,
            costs=costs,
            max_cost=max_cost,
            count_miss=not kept,  # a declined copy was counted as cost_recomputed
            held=held,  # a declined host copy is not held: memory's prefix is
        )
        if found is not None:
            cache, row, prefix = found
            return Restored(cache, toks[:prefix], listed_info(row))
    if not ram or host is None:
        return None
    from .host.store_hooks import from_host

    costs.last = taken  # the decision this lookup acts on (a durable one may have followed)
    return from_host(
        store,
        host,
        toks,
        identity=identity,
        namespace=namespace,
        who=who,
        longer_than=longer_than,
        max_cost=max_cost,
    )
