"""A named session read where it is the fleet's latest: the cold tier's pointer first.

A push moves the cold tier's session pointer first, then the shared tier's
(``fleet_sync.push_everywhere``).  A pusher killed between the two, or a Redis
that lost a write (a failover, a restore from an older RDB), leaves Redis naming
an older version of the session than S3, and a machine that resumed Redis's
continued an old history: a fork (issue 38).  So a shared tier that knows its
cold tier (``Shared.backup``) asks the cold tier's pointer first and reads the
record and blobs from Redis only where Redis's pointer is byte-equal to it (a
pointer names a record by the hash of its content: equal pointers, one record).
Otherwise the session is read from the cold tier, and Redis's pointer is repaired
once the pull is committed: the snapshot pushed again and its pointer set to the
cold tier's exactly, by a compare-and-set over the stale value the pull read and
only where Redis's version is older (``push.push`` with ``repair``,
``lineage.stale_held``; counted ``<tier>_repaired``, ``<tier>_repair_declined``).
Where the two pointers differ the newer version by lineage wins, whichever tier
holds it (a record's save time, a tombstone's version), where it continues the
other (its tokens extend the other's, or the other is a tombstone or nothing).
Two records neither of which extends the other are a fork (``lineage.forked``: a
tier lost its pointer, an LRU, and a machine without the other tier started a new
conversation under the name there; attack 38c, finding 2): the cold tier decides
the name, its history is read, and the other tier's is left as it is, never
repaired over (counted ``<tier>_forked``, logged); a machine holding either pushes
it beside as ``NAME~N`` (``fleet_plan``).  Otherwise: a cold tier restored from
backup or rolled back, or one a machine with only ``--shared`` never wrote, names
an older version than Redis, and resuming it let the next push replace Redis's
newer turn or tombstone (attack 38b, finding 1); the cold tier is then repaired
from Redis the same way.  A cold tier without a pointer of the name (machines
without one pushed it) leaves Redis's, but gets Redis's tombstone: an empty tier
cannot prove a delete undone.  A cold tier that cannot be asked leaves Redis's too, said once per
outage: that version may be behind the cold tier (counted ``<tier>_cold_unasked``).

A pointer of the name whose record cannot be read here (not this machine's operator
key's, or its record gone: an LRU, a TTL) is ``Unreadable``, not a miss: a caller
that took it for "no session" would start a new conversation over the fleet's
(attack 38b, findings 5 and 8).  A tombstone, a replay (``stale``) and a value that
does not open at all (``malformed``) stay misses.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from ...remote.redis_tier import TierUnavailable
from ...storage.blobs import BlobStore
from ...storage.index import Index
from .lineage import (
    RepairDeclined,
    forked,
    open_tombstone,
    shown_url,
    stale_held,
    tier_tokens,
)
from .push import push
from .records import BadValue, Expect, open_record

__all__ = ["Found", "Unreadable", "UNREADABLE", "named_record", "repair"]

log = logging.getLogger("persist")
COLD = "cold"  # the cold tier's counters' prefix (``exchange.open_tiers`` names it so)
UNREADABLE = ("unauthenticated",)  # a value another operator key (or none) tagged


class Unreadable(Exception):
    """The tier names the session, but what it names cannot be read by this machine:
    ``name`` and ``tier`` say which tier, ``keyed`` whether the operator key is why."""

    def __init__(self, name: str, tier: Any, detail: str, keyed: bool) -> None:
        super().__init__(detail)
        self.name, self.tier, self.detail, self.keyed = name, tier, detail, keyed


class Lagging(NamedTuple):
    """The tier whose pointer of a name is behind the other's: repaired after the pull."""

    tier: Any  # the shared tier or its cold tier
    name: str  # whose counters (``shared``, ``cold``)
    value: bytes | None  # what was read there (the compare-and-set's expected value)
    want: bytes  # the newer tier's pointer, exactly


class Found(NamedTuple):
    """A named session's checked record and where it was read."""

    body: dict[str, Any]
    secret: bytes | None  # the secret its chains are under
    tier: Any  # where its blobs are read: the shared tier, or its cold tier
    name: str  # whose counters (``shared``, ``cold``)
    stale: Lagging | None  # the other tier, behind this one: repaired


class _Source(NamedTuple):
    tier: Any
    name: str
    pointer: bytes | None
    stale: Lagging | None


def named_record(
    shared: Any, index: Index, namespace: str, name: str, secret: bytes | None
) -> Found | None:
    """The checked record of session ``name`` (``shared``: a ``tiers.Shared``) and the
    tier it is read from; None for none, a bad value (counted), a version older than
    one this store saw (a replay: ``stale``) and a tombstone (deleted from the fleet:
    its version is seen here, and a stale Redis pointer is replaced by it)."""
    src = _source(shared, index, namespace, name, secret)
    if src.pointer is None:
        return None
    if src.tier is not shared.tier:  # the cold tier's secret: its record's own, or derived
        secret = shared.keys.namespace_secret(namespace)
    try:
        gone = open_tombstone(shared.keys, namespace, name, src.pointer)
        if gone is not None:
            if gone < (index.seen(namespace, name) or 0.0):
                raise BadValue("stale", "a tombstone older than a version this store saw")
            index.saw(namespace, name, gone)
            if src.stale is not None:
                _repair_tombstone(shared, index, namespace, name, src.stale, gone)
            return None
        keys = shared.keys
        rkey = keys.open_pointer(namespace, "sess", name.encode(), src.pointer)
        value = src.tier.records(namespace, [rkey])[0]
        if value is None:  # the pointer outlived its record (an LRU, a TTL)
            index.count(namespace, **{f"{src.name}_incomplete": 1})
            raise Unreadable(src.name, src.tier, "its record is gone (evicted, expired)", False)
        if secret is None:  # the tier holds no secret (keyless): the record's own
            bare = open_record(keys, value, Expect(namespace, rkey, name=name))
            secret = bare.get("secret")
            if secret is None:  # a keyed fleet's record, read without its key
                index.count(namespace, **{f"{src.name}_mismatched": 1})
                why = "a record without the secret of its chains"
                raise Unreadable(src.name, src.tier, why, True)
        body = open_record(keys, value, Expect(namespace, rkey, name=name, secret=secret))
        seen = index.seen(namespace, name)
        if seen is not None and float(body["row"]["created"]) < seen:
            raise BadValue("stale", "a version older than one this store saw (a replay)")
        return Found(body, secret, src.tier, src.name, src.stale)
    except BadValue as e:
        index.count(namespace, **{f"{src.name}_{e.why}": 1})
        log.info("persist: %s tier value refused: %s", src.name, e.detail)
        if e.why == "stale":  # named there, refused here: never "not in any tier"
            shared.replayed = (src.name, src.tier, e.detail)
        if e.why in UNREADABLE:
            raise Unreadable(src.name, src.tier, e.detail, True) from None
        return None


def _source(shared: Any, index: Index, namespace: str, name: str, secret: bytes | None) -> _Source:
    """Whose pointer of ``name`` a pull follows: the cold tier's is asked first; Redis's
    where it is the same (its bytes are closer), where the cold tier holds none (a
    tombstone there is also put on the cold tier), or where it names a newer version
    (or tombstone) than the cold tier's, which is then repaired; the cold tier's,
    neither repaired, where the two are different histories (a fork); else the cold
    tier's, and Redis's repaired.  Redis's alone where there is no cold tier or it
    cannot be asked (said once per outage).  TierUnavailable where Redis cannot be
    asked."""
    item = [("sess", name.encode())]
    if shared.backup is None:
        return _Source(shared.tier, shared.name, shared.tier.pointers(namespace, item)[0], None)
    try:
        cold: bytes | None = shared.backup.pointers(namespace, item)[0]
    except TierUnavailable as e:
        mine = shared.tier.pointers(namespace, item)[0]
        if mine is not None:
            _unasked(shared, index, namespace, name, e)
        return _Source(shared.tier, shared.name, mine, None)
    shared.behind_said = False  # the cold tier answers: a later outage is said again
    mine = shared.tier.pointers(namespace, item)[0]
    if mine == cold or (cold is None and not (mine or b"").startswith(b"~")):
        return _Source(shared.tier, shared.name, mine, None)
    # the tiers disagree: the newer version by lineage wins, whichever tier holds it
    # (a cold tier rolled back, or one a machine with only --shared never wrote, is
    # not the fleet's latest: attack 38b, finding 1), and the other tier is repaired
    theirs = tier_tokens(
        shared.backup, shared.keys, namespace, name, shared.keys.namespace_secret(namespace)
    )
    ours = tier_tokens(shared.tier, shared.keys, namespace, name, secret)
    if forked(ours, theirs):  # two histories: the cold tier decides, neither is repaired
        _forked(shared, index, namespace, name)
        return _Source(shared.backup, COLD, theirs.value, None)
    if ours.value is not None and (ours.version or 0.0) > (theirs.version or 0.0):
        lag = Lagging(shared.backup, COLD, theirs.value, ours.value)
        return _Source(shared.tier, shared.name, ours.value, lag)
    if theirs.value is None:  # gone from the cold tier meanwhile: Redis's, as it is
        return _Source(shared.tier, shared.name, ours.value, None)
    lag = Lagging(shared.tier, shared.name, ours.value, theirs.value)
    return _Source(shared.backup, COLD, theirs.value, lag)


def _forked(shared: Any, index: Index, namespace: str, name: str) -> None:
    index.count(namespace, **{f"{shared.name}_forked": 1})
    log.warning(
        "persist: session %r: the cold tier (%s) and the %s tier (%s) hold two different "
        "histories under the name (neither continues the other: a tier lost its pointer "
        "and a machine without the other tier started a conversation there); the cold "
        "tier's is read, the %s tier's is left as it is (its machines resume it); a "
        "machine holding either pushes it beside as NAME~N on sync",
        name, shown_url(shared.backup.url), shared.name, shown_url(shared.tier.url), shared.name,
    )  # fmt: skip


def _unasked(shared: Any, index: Index, namespace: str, name: str, e: Exception) -> None:
    index.count(namespace, **{f"{shared.name}_cold_unasked": 1})
    if shared.behind_said:
        return
    shared.behind_said = True
    log.warning(
        "persist: session %r is read from the %s tier (%s) while the cold tier (%s) cannot "
        "be asked (%s): it may be behind the cold tier, whose version of a session is the "
        "fleet's latest; said once until the cold tier answers",
        name, shared.name, shown_url(shared.tier.url), shown_url(shared.backup.url), e,
    )  # fmt: skip


def repair(
    shared: Any, index: Index, blobs: BlobStore, namespace: str, name: str, found: Found
) -> None:
    """After a pull from the newer tier: the lagging tier's pointer of ``name`` set to
    the newer one's, the snapshot (just committed here) pushed there first, the
    pointer written only over the stale value the pull read (``push`` with
    ``repair``).  A declined repair is counted and leaves that tier as it is: a newer
    push got there, or the record seals otherwise there (another namespace secret)."""
    row, lag = index.by_name(namespace, name), found.stale
    secret = shared.secret(index, namespace)
    if row is None or secret is None or lag is None:
        return
    before = lag.tier.counters.get("bytes_pushed", 0)
    try:
        push(
            index, blobs, lag.tier, keys=shared.keys, namespace=namespace, sid=row.id,
            secret=secret, repair=(lag.value, lag.want),
        )  # fmt: skip
    except RepairDeclined as e:
        index.count(namespace, **{f"{lag.name}_repair_declined": 1})
        log.info("persist: %s tier's session %r not repaired: %s", lag.name, name, e)
        return
    except TierUnavailable as e:  # the next pull tries again
        log.info("persist: %s tier's session %r not repaired: %s", lag.name, name, e)
        return
    finally:
        moved = lag.tier.counters.get("bytes_pushed", 0) - before
        if moved:
            index.count(namespace, **{f"{lag.name}_bytes_pushed": moved})
    index.count(namespace, **{f"{lag.name}_repaired": 1})
    log.info("persist: %s tier's session %r repaired to the newer tier's", lag.name, name)


def _repair_tombstone(
    shared: Any, index: Index, namespace: str, name: str, lag: Lagging, version: float
) -> None:
    """The newer tier's tombstone of ``name`` put over the lagging tier's pointer (a
    fleet delete that reached one tier only, a tier that lost it or came back empty
    or rolled back), by compare-and-set."""
    try:
        secret = (
            shared.secret(index, namespace)
            if lag.tier is shared.tier
            else shared.keys.namespace_secret(namespace)
        )
        held = stale_held(
            lag.tier, shared.keys, namespace, name, secret=secret, stale=lag.value,
            version=version,
        )  # fmt: skip
        done = lag.tier.swap_session(namespace, name.encode(), lag.want, held.token)
    except RepairDeclined:
        done = False
    except TierUnavailable:
        return
    what = "repaired" if done else "repair_declined"
    index.count(namespace, **{f"{lag.name}_{what}": 1})
