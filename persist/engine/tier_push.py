"""The writing side of a tier: the namespace secret every machine must agree on, and
the push of one committed snapshot (its missing blobs, its sealed record, its pointers).

The chain secret decides every chain and content key, so two machines share a
namespace only if they hold the same one.  With an operator key it is derived,
HMAC(key, namespace): nothing on a tier, nothing an LRU can evict.  Without one
it lives on the tier as before, but where eviction cannot lose it for good: the
cold tier keeps a copy (S3 evicts nothing), every save writes it again (SET NX,
in the record's round trip), every record carries it (a new machine restoring a
session adopts it from the record), and a lookup on a machine that has none
finds a record by a bounded SCAN and recovers it from there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgpack

from ..format.tokens import unpack_tokens
from ..store.blobs import BlobStore
from ..store.chains import boundary_heads
from ..store.index import Index
from ..store.redis_tier import TierUnavailable
from .tier_records import ROW_FIELDS, BadValue, Expect, Keys, open_record, seal_record


class Shared(Protocol):
    """What of ``tiers.Shared`` the secret needs (a protocol: tiers imports this module)."""

    tier: Any
    name: str
    keys: Keys
    backup: Any
    unreachable: int  # operations the tier was down for

    def push(self, index: Index, blobs: BlobStore, namespace: str, sid: int) -> str: ...

    def pull_session(self, index: Index, blobs: BlobStore, namespace: str, name: str) -> bool: ...


Tier = Any  # a RedisTier or S3Tier (their common methods)

__all__ = ["namespace_secret", "push", "sync"]

log = logging.getLogger("persist")
_told: set[tuple[str, str]] = set()


def namespace_secret(
    shared: Shared, index: Index, namespace: str, create: bool
) -> tuple[bytes, bool] | None:
    """(the namespace's secret, whether the fleet's is known to be it), or None: not
    shared (this store chained it with another one), or no secret anywhere yet and
    ``create`` false.  A store with no secret of its own adopts the fleet's."""
    local = index.secret(namespace)
    derived = shared.keys.namespace_secret(namespace)
    if derived is not None:
        fleet: bytes | None = derived
    else:
        fleet = shared.tier.get_secret(namespace)
        if fleet is None and local is None:  # a machine with one keeps using its own
            fleet = _recovered(shared, index, namespace)
            if fleet is not None:  # put back where the next machine looks first
                shared.tier.secret(namespace, fleet)
        if fleet is None and local is not None:
            if not create:
                return local, False  # a read never creates the namespace on the tier
            fleet = shared.tier.secret(namespace, local)
        if fleet is None:
            if not create:
                return None
            fleet = shared.tier.secret(namespace, os.urandom(32))
    assert fleet is not None
    if local is None:
        local = index.set_secret(namespace, fleet)
    if local != fleet:
        if (shared.tier.url, namespace) not in _told:
            _told.add((shared.tier.url, namespace))
            log.warning(
                "persist: namespace %r has another secret on %s: not shared",
                namespace,
                shared.tier.url,
            )
        return None
    return local, True


def _recovered(shared: Shared, index: Index, namespace: str) -> bytes | None:
    """A secret the tier lost, from the cold tier, or from one of the tier's records."""
    if shared.backup is not None:
        try:
            held = shared.backup.get_secret(namespace)
        except TierUnavailable:
            held = None
        if held is not None:
            return held
    value = shared.tier.any_record(namespace)
    if value is None:
        return None
    try:
        body = open_record(shared.keys, value, Expect(namespace))
        secret = body.get("secret")
        if secret is None:
            return None
        open_record(shared.keys, value, Expect(namespace, secret=secret))  # its chains agree
    except BadValue:
        return None
    index.count(namespace, **{f"{shared.name}_secret_recovered": 1})
    return bytes(secret)


def push(
    index: Index, blobs: BlobStore, tier: Tier, keys: Keys, namespace: str, sid: int, secret: bytes
) -> str:
    """Write a committed snapshot's missing blobs and its record to the tier: ``pushed``,
    ``present`` (nothing was missing), ``skipped`` (gone meanwhile, or a snapshot
    this tier does not keep)."""
    with index.read() as db:
        (row,) = Index.rows_where(db, "id = ?", [sid])
        refs = Index.blocks_in(db, sid)
    name = row.name if row.role == "session" else None
    if name is None and getattr(tier, "named_only", False):
        return "skipped"
    files = [row.tail, *(r.blob for r in refs if r.blob)]
    facts = index.blob_facts(files)
    if len(facts) != len(set(files)):
        return "skipped"  # evicted or replaced meanwhile: nothing to share
    by_key = {facts[f][0]: f for f in set(files)}
    fields: dict[str, Any] = {k: getattr(row, k) for k in ROW_FIELDS}
    body: dict[str, Any] = {
        "row": {**fields, "trimmable": bool(row.trimmable)},
        "blocks": [[r.idx, r.chain, facts[r.blob][0] if r.blob else None] for r in refs],
        "tail": facts[row.tail][0],
        "blobs": {facts[f][0]: [facts[f][1], facts[f][2]] for f in sorted(set(files))},
        "secret": None if keys.key is not None else secret,  # a derived one is kept nowhere
    }
    rkey, record = seal_record(keys, namespace, body)
    missing = tier.missing_blobs(namespace, sorted(by_key))
    had = not missing and tier.has_record(namespace, rkey)

    def put(key: str) -> None:
        with blobs.open(by_key[key]) as fh:
            data = fh.read()
        tier.put_blob(namespace, key, data, bool(row.pinned), keys.blob_tag(namespace, key, data))

    with ThreadPoolExecutor(4) as pool:  # the tier's client is thread-safe
        list(pool.map(put, missing))
    tier.put_record(
        namespace, rkey, record, _pointers(keys, namespace, row, refs, name, rkey),
        bool(row.trimmable), None if keys.key is not None else secret,
    )  # fmt: skip
    return "present" if had else "pushed"


def _pointers(
    keys: Keys, namespace: str, row: Any, refs: Any, name: str | None, rkey: str
) -> list[tuple[str, bytes, bytes]]:
    """(kind, key, value) of every pointer to the record: by name, chain, head key."""
    chs = [r.chain for r in refs]
    block = int(msgpack.unpackb(row.manifest, raw=False)["block"])
    heads = boundary_heads([row.root, *chs], unpack_tokens(row.tokens), block)
    items = [("blk", c) for c in chs] + [("head", h) for h in heads]
    if name is not None:
        items.insert(0, ("sess", name.encode()))
    return [(kind, key, keys.pointer(namespace, kind, key, rkey)) for kind, key in items]


def sync(
    index: Index,
    blobs: BlobStore,
    shared: Sequence[Shared],
    namespace: str | None,
    names: list[str],
) -> dict[str, Any]:
    """Push every local snapshot (of ``namespace``) to the tiers (each push writes only
    what a tier lacks), then pull the named sessions this store lacks.  The report says
    what happened: per tier, snapshots pushed, already there, failed."""
    rows = index.snapshots(namespace, named_only=False)
    per: dict[str, dict[str, int]] = {
        t.name: {"pushed": 0, "present": 0, "failed": 0} for t in shared
    }
    failed: set[int] = set()
    for row in rows:
        for tier in shared:
            how = tier.push(index, blobs, row.namespace, row.id)
            if how in per[tier.name]:
                per[tier.name][how] += 1
            if how == "failed":
                failed.add(row.id)
    pulled, unreached = [], []
    for name in names:
        ns = namespace or "default"
        down = False
        for tier in shared:
            if index.by_name(ns, name) is None:
                before = tier.unreachable
                tier.pull_session(index, blobs, ns, name)
                down = down or tier.unreachable > before
        if index.by_name(ns, name) is not None:
            pulled.append(name)
        elif down:  # a tier that could not be asked: a failure, not "not in any tier"
            unreached.append(name)
    total = {k: sum(p[k] for p in per.values()) for k in ("pushed", "present", "failed")}
    return {
        **total,
        "snapshots": len(rows),
        "snapshots_failed": len(failed),
        "tiers": per,
        "pulled": pulled,
        "unreached": sorted(set(unreached)),
        "missing": sorted(set(names) - set(pulled) - set(unreached)),
    }
