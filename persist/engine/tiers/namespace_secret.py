"""The namespace secret every machine of a fleet must agree on (``Shared.secret``).

The chain secret decides every chain, so the records on a tier are chained under
one secret, the tier's (the fleet's); a store keeps its own for its local rows
and rechains a record at the tier's edge when the two differ (a store that
shared before an operator key was set, or before the tier lost everything).
With an operator key the tier's secret is derived, HMAC(key, namespace):
nothing on a tier, nothing an LRU can evict.  Without one it lives on the tier,
where eviction cannot lose it for good: every save writes it again and reads
it back (SET NX, in the record's round trip: a machine that finds another one
there uses that one from then on), every record carries it (a new machine
restoring a session adopts it from the record), a machine that finds none
recovers it from a record found by a bounded SCAN, else from the cold tier.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ...remote.redis_tier import TierUnavailable
from ...storage.index import Index
from .records import BadValue, Expect, open_record

if TYPE_CHECKING:
    from .push import Shared

__all__ = ["namespace_secret"]


def namespace_secret(
    shared: Shared, index: Index, namespace: str, create: bool, last: bytes | None = None
) -> bytes | None:
    """The fleet's secret for this namespace on this tier, or None: none anywhere and
    not ``create`` (a read never creates a namespace).  With a key it is derived.
    Without one the tier's is the fleet's: one it lost is recovered (from its records,
    else the cold tier) or planted again (SET NX, then read back, so machines that
    race agree on one) from ``last`` (the one this process used), the store's own, or
    a new one.  A store without a secret of its own for the namespace adopts it; a
    store with another one keeps its own and rechains at the tier's edge (``push``,
    ``tiers.pull``), so no secret that changed on a tier splits the fleet."""
    fleet = shared.keys.namespace_secret(namespace)
    if fleet is None:
        fleet = shared.tier.get_secret(namespace)
        if fleet is None:
            found = _recovered(shared, index, namespace)
            if found is None and not create:
                return None
            mine = found or last or index.secret(namespace) or os.urandom(32)
            fleet = shared.tier.secret(namespace, mine)
    if index.secret(namespace) is None:
        index.set_secret(namespace, fleet)
    return fleet


def _recovered(shared: Shared, index: Index, namespace: str) -> bytes | None:
    """A secret the tier lost, from one of its records (the first that opens: a bad one
    is a counted miss, and the search is bounded, ``recovery_records``), else from the
    cold tier (S3 evicts nothing).  A search the tier's ACL refuses (docs/fleet.md's
    recipe refuses SCAN: it lists every tenant's key names) finds nothing: the caller
    plants a secret again, and a store whose own differs rechains at the tier's edge."""
    try:
        found = list(shared.tier.recovery_records(namespace))
    except TierUnavailable as e:
        if not e.denied:
            raise
        index.count(namespace, **{f"{shared.name}_recovery_refused": 1})
        found = []
    for value in found:
        try:
            body = open_record(shared.keys, value, Expect(namespace))
            secret = body.get("secret")
            if secret is None:
                continue  # a record written with an operator key carries none
            open_record(shared.keys, value, Expect(namespace, secret=secret))  # its chains agree
        except BadValue as e:
            index.count(namespace, **{f"{shared.name}_{e.why}": 1})
            continue
        index.count(namespace, **{f"{shared.name}_secret_recovered": 1})
        return bytes(secret)
    if shared.backup is not None:
        try:
            held: bytes | None = shared.backup.get_secret(namespace)
        except TierUnavailable:
            return None
        return held
    return None
