"""The writing side of a tier: the push of one committed snapshot (its missing blobs,
its sealed record, its pointers).  The namespace secret every machine must agree on
is ``namespace_secret``'s.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgpack

from ...format.tokens import unpack_tokens
from ...remote.pointer_swap import SessionMoved
from ...remote.redis_tier import TierUnavailable
from ...storage.blobs import BlobStore
from ...storage.chains import boundary_heads
from ...storage.index import Index
from .fleet_plan import left_stripped
from .lineage import Foreign, RepairDeclined, kept_name, past, stale_held, tier_tokens
from .records import ROW_FIELDS, BadValue, Expect, Keys, chains_under, open_record, seal_record


class Shared(Protocol):
    """What of ``tiers.Shared`` the secret needs (a protocol: tiers imports this module)."""

    tier: Any
    name: str
    keys: Keys
    backup: Any
    unreachable: int  # operations the tier was down for
    conflicts: list[tuple[str, str]]  # (session, the name its other history was pushed as)
    refused: list[tuple[str, str]]  # (session, why): a value there not authenticated here
    rekey: bool  # this machine's key is the fleet's: values under another key are replaced
    unread: str | None  # why the last pull_session could not read its session
    held_here: str | None  # what its session is to this store's (``pull.relation``)

    def refuse(
        self, index: Index, namespace: str, name: str, detail: str, rotating: bool = False
    ) -> None: ...

    def replay_why(self) -> str | None: ...

    def push(
        self,
        index: Index,
        blobs: BlobStore,
        namespace: str,
        sid: int,
        verify: bool = False,
        as_name: str | None = None,
        base: tuple[float | None] | None = None,
        beside: bool = False,
        replace_foreign: bool = False,
        live: bool = False,
    ) -> str: ...

    def pull_session(
        self, index: Index, blobs: BlobStore, namespace: str, name: str, over: Any = None
    ) -> bool: ...


Tier = Any  # a RedisTier or S3Tier (their common methods)

__all__ = ["push"]

log = logging.getLogger("persist")
MAX_RACES = 8  # pushes of one snapshot that may lose the race for its name before it fails


def push(
    index: Index,
    blobs: BlobStore,
    tier: Tier,
    *,
    keys: Keys,
    namespace: str,
    sid: int,
    secret: bytes,
    verify: bool = False,
    conflicts: list[tuple[str, str]] | None = None,
    as_name: str | None = None,
    repair: tuple[bytes | None, bytes] | None = None,
    replaced: list[str] | None = None,
    base: tuple[float | None] | None = None,
    beside: bool = False,
    rekey: bool = False,
    replace: bool = False,
    live: bool = False,
) -> tuple[str, bytes | None]:
    """Write a committed snapshot's missing blobs and its record to the tier: ``pushed``,
    ``present`` (nothing was missing or wrong), ``skipped`` (gone meanwhile, or a
    snapshot this tier does not keep); and the tier's secret after the write (without
    a key).  The record's chains are under ``secret``, the tier's, whatever the
    store's own.  A blob the tier holds is read and compared with what would be
    written, once per process (``tier.marks``), or every time with ``verify``
    (``sync``), and so is the record with ``verify``: a wrong value (a hostile
    writer's, planted ahead of the save or written over it) is overwritten.  A session
    that does not continue the tier's session of its name is pushed as ``NAME~N``
    beside it (``lineage.kept_name``), and (name, kept name) is added to ``conflicts``.
    ``as_name``: the ``NAME~N`` another tier's conflict gave this session
    (``push_everywhere``), taken here too.  ``repair``: (the stale value a named pull
    read in this tier's session pointer, the cold tier's pointer): the pointer is set
    to exactly the cold tier's, over that stale value only, where the tier's version
    is older (``lineage.stale_held``); RepairDeclined otherwise (``named_pull``).
    ``base``: (``Index.base`` of the name, read before the first tier's push:
    ``push_everywhere``), so a name the cold tier's push just took is no licence to
    replace a later tier's newer tombstone; None: read here.  ``beside``: another tier
    holds a session of the name this one does not continue: not the name.
    ``live``: another tier holds this copy's own history (``fleet_plan``): a newer
    history here that does not extend it is a fork, not the fleet's past (``past``).
    A session whose name holds a value this machine cannot authenticate (another
    operator key's, none, forged) is ``Foreign``, before anything is written, unless
    ``rekey`` (this machine's key is the fleet's: a rotation; its lineage, read without
    its tag, then decides as any other's: ``kept_name``) or ``replace`` (another tier
    vouched for this key: ``fleet_plan``; it is a planted value, replaced unjudged);
    a name whose foreign value was written over is added to ``replaced``."""
    with index.read() as db:
        rows = Index.rows_where(db, "id = ?", [sid])
        refs = Index.blocks_in(db, sid)
    if not rows:
        return "skipped", None  # evicted meanwhile
    row = rows[0]
    name = row.name if row.role == "session" else None
    if name is not None and as_name is not None:
        name = as_name
    if base is None:
        base = (index.base(namespace, name) if name is not None else None,)  # before this push
    if name is None and getattr(tier, "named_only", False):
        return "skipped", None
    if name is not None and repair is None:
        held = tier_tokens(tier, keys, namespace, name, secret, peek=rekey, by_record=True)
        if held.foreign is not None and not (rekey or replace):  # maybe the fleet's
            raise Foreign(name, held.foreign)
        seen = index.seen(namespace, name)
        old = None if as_name is not None else past(held, row, base[0], seen, live)
        if old is not None:  # a copy of the fleet's own past: nothing to push
            return old, None
    files = [row.tail, *(r.blob for r in refs if r.blob)]
    facts = index.blob_facts(files)
    if len(facts) != len(set(files)):
        return "skipped", None  # evicted or replaced meanwhile: nothing to share
    by_key = {facts[f][0]: f for f in set(files)}
    fields: dict[str, Any] = {k: getattr(row, k) for k in ROW_FIELDS}
    chs = [r.chain for r in refs]
    if secret != index.secret(namespace):  # this store chains the namespace otherwise
        under, fields["last_chain"] = chains_under(secret, fields, len(refs))
        fields["root"], chs = under[0], under[1:]
    body: dict[str, Any] = {
        "row": {**fields, "trimmable": bool(row.trimmable)},
        "blocks": [
            [r.idx, c, facts[r.blob][0] if r.blob else None] for r, c in zip(refs, chs, strict=True)
        ],
        "tail": facts[row.tail][0],
        "blobs": {facts[f][0]: [facts[f][1], facts[f][2]] for f in sorted(set(files))},
        "secret": None if keys.key is not None else secret,  # a derived one is kept nowhere
    }
    names = {keys.blob_name(k): k for k in by_key}
    missing = tier.missing_blobs(namespace, sorted(names))
    present = [n for n in sorted(names) if n not in set(missing)]
    if not verify:  # those this process wrote or read as right are not read again
        present = [n for n in present if not tier.marks.is_good(namespace, n)]

    def value(name: str) -> tuple[bytes, bytes | None]:
        with blobs.open(by_key[names[name]]) as fh:
            data = fh.read()
        return data, keys.blob_tag(namespace, names[name], data)

    def right(name: str) -> bool:
        if tier.blob_matches(namespace, name, *value(name)):
            tier.marks.good(namespace, name)
            return True
        log.warning("persist: replacing a wrong value of blob %s on %s", name, tier.url)
        return False

    def put(name: str, replace: bool = False) -> None:
        data, tag = value(name)
        tier.put_blob(namespace, name, data, bool(row.pinned), tag, replace=replace)

    with ThreadPoolExecutor(4) as pool:  # the tier's client is thread-safe
        wrong = [n for n, ok in zip(present, pool.map(right, present), strict=True) if not ok]
        list(pool.map(put, missing))
        list(pool.map(lambda n: put(n, replace=True), wrong))
    last: SessionMoved | None = None
    for _ in range(MAX_RACES):  # a race lost: the tier's session read again, decided again
        try:
            kept, after, had, foreign = _write_record(
                tier,
                keys,
                namespace,
                fields=fields,
                body=body,
                chs=chs,
                name=name,
                base=base[0],
                secret=secret,
                verify=verify,
                repair=repair,
                beside=beside,
                rekey=rekey,
                replace=replace,
                turn=base[0] is None or float(row.created) > base[0],
            )
            break
        except SessionMoved as e:
            if repair is not None:  # its compare-and-set lost to a newer push: not again
                raise RepairDeclined(str(e)) from None
            last = e
    else:
        raise TierUnavailable(f"{last}: {MAX_RACES} pushes in a row lost the race; not pushed")
    if foreign and name is not None and kept == name and replaced is not None:
        replaced.append(name)  # a value under the name not authenticated here, replaced
    if name is not None and kept is not None and kept != name and conflicts is not None:
        conflicts.append((name, kept))  # another history holds the name: both are kept
    if kept is not None:  # this version or a later one: an older record is a replay.
        # Only once on the tier, under the name it took: a version that never got
        # there (a tier down) is not one the tier's history may be replaced by.
        index.saw(namespace, kept, row.created)
    return "present" if had and not missing and not wrong else "pushed", after


def _write_record(
    tier: Tier,
    keys: Keys,
    namespace: str,
    *,
    fields: dict[str, Any],
    body: dict[str, Any],
    chs: list[bytes],
    name: str | None,
    base: float | None,
    secret: bytes,
    verify: bool,
    repair: tuple[bytes | None, bytes] | None = None,
    beside: bool = False,
    rekey: bool = False,
    replace: bool = False,
    turn: bool = True,
) -> tuple[str | None, bytes | None, bool, bool]:
    """The record and its pointers, under the name the snapshot takes (``kept_name``:
    ``name`` or ``NAME~N``), its session pointer written only over what was read there
    (SessionMoved otherwise); (that name, the tier's secret after, whether the record
    and every pointer were there and right already, whether the session pointer
    written over was one not authenticated here).  ``repair``: ``push``'s.  ``turn``:
    the snapshot was saved here since this store last pushed or pulled the name (not a
    copy): only a turn moves on a pointer whose tag was stripped (``left_stripped``)."""
    if name is not None:  # a race lost before: sealed under its own name again
        fields["name"] = body["row"]["name"] = name
    rkey, record = seal_record(keys, namespace, body)
    session, kept, same, foreign = None, name, True, False
    if name is not None:
        if repair is not None:  # the cold tier's record, exactly, over the stale value
            if keys.pointer(namespace, "sess", name.encode(), rkey) != repair[1]:
                raise RepairDeclined(f"session {name!r} seals otherwise here (another secret)")
            version = float(fields["created"])
            held = stale_held(
                tier, keys, namespace, name, secret=secret, stale=repair[0], version=version,
                tokens=unpack_tokens(fields["tokens"]), rkey=rkey,
            )  # fmt: skip
        else:
            toks = unpack_tokens(fields["tokens"])
            kept, held = kept_name(
                tier, keys, namespace, name, secret=secret, tokens=toks, rkey=rkey, base=base,
                beside=beside, rekey=rekey, replace=replace,
            )  # fmt: skip
            if kept != name:
                fields["name"] = body["row"]["name"] = kept
                rkey, record = seal_record(keys, namespace, body)
        ptr = keys.pointer(namespace, "sess", (kept or name).encode(), rkey)
        session, same = ((kept or name).encode(), ptr, held.token), held.rkey == rkey
        foreign = (held.foreign or held.stripped) is not None and held.value != ptr
        same = same and not foreign  # a stripped or forged tag over this record: rewritten
        if left_stripped(tier, held, kept or name, turn or replace or repair is not None):
            session, same, foreign = None, True, False
    on_tier = tier.records(namespace, [rkey])[0] if verify else None
    good_record = on_tier == record if verify else tier.has_record(namespace, rkey)
    ptrs = _pointers(keys, namespace, fields, chs, rkey)
    trimmable = bool(fields["trimmable"])
    bad: set[tuple[str, bytes]] = set()
    if verify:  # a pointer another record serving its prefix holds is left as it is
        bad, others = _check_pointers(tier, keys, namespace, ptrs, trimmable, secret)
        ptrs = [p for p in ptrs if (p[0], p[1]) not in others]
    after = tier.put_record(
        namespace,
        rkey,
        record,
        ptrs,
        trimmable=trimmable,
        secret=None if keys.key is not None else secret,
        replace=verify and on_tier is not None and not good_record,
        replace_pointers=bad,
        session=session,
    )
    return kept, after, good_record and not bad and same, foreign  # same: it named it


def _check_pointers(
    tier: Tier,
    keys: Keys,
    namespace: str,
    ptrs: list[tuple[str, bytes, bytes]],
    trimmable: bool,
    secret: bytes,
) -> tuple[set[tuple[str, bytes]], set[tuple[str, bytes]]]:
    """(kind, key) of the pointers a sync must write again (absent, not a pointer, not
    authentic, or naming a record that does not serve their prefix), and of those it
    leaves to another record.  A chain or head key is the prefix it serves, so a
    pointer naming another valid record whose chains hold that key is right: two
    histories that share a head (``chat`` and its fork ``chat~2``) would otherwise
    take it from each other on every sync, forever.  An untrimmable snapshot's
    pointers that name another authentic record stay too: the first, shortest
    snapshot to reach a chain keeps it (it serves only prompts holding all of it)."""
    kept = [(kind, key, value) for kind, key, value in ptrs if kind in tier.pointer_kinds]
    held = tier.pointers(namespace, [(kind, key) for kind, key, _ in kept])
    wrong, others = set(), set()
    named: dict[tuple[str, bytes], str] = {}  # a trimmable one's: checked against its record
    for (kind, key, value), got in zip(kept, held, strict=True):
        if got is not None and bytes(got) == value:
            continue
        try:
            if got is not None and kind != "sess":
                rkey = keys.open_pointer(namespace, kind, key, got)
                if not trimmable:
                    others.add((kind, key))  # another snapshot's own pointer
                else:
                    named[(kind, key)] = rkey
                continue
        except BadValue:
            pass
        wrong.add((kind, key))
    rkeys = sorted(set(named.values()))
    bodies = dict(zip(rkeys, tier.records(namespace, rkeys) if rkeys else [], strict=True))
    for via, rkey in named.items():
        if _serves(keys, bodies[rkey], Expect(namespace, rkey, secret=secret, via=via)):
            others.add(via)
        else:
            wrong.add(via)
    return wrong, others


def _serves(keys: Keys, value: bytes | None, want: Expect) -> bool:
    """Is ``value`` a valid trimmable record whose chains hold ``want.via``'s key?"""
    if value is None:
        return False  # evicted: the pointer leads nowhere
    try:
        return bool(open_record(keys, value, want)["row"]["trimmable"])
    except BadValue:
        return False


def _pointers(
    keys: Keys, namespace: str, row: dict[str, Any], chs: list[bytes], rkey: str
) -> list[tuple[str, bytes, bytes]]:
    """(kind, key, value) of the record's pointers by chain and head key (the one by name
    is written on its own: ``_write_record``)."""
    block = int(msgpack.unpackb(row["manifest"], raw=False)["block"])
    heads = boundary_heads([row["root"], *chs], unpack_tokens(row["tokens"]), block)
    items = [("blk", c) for c in chs] + [("head", h) for h in heads]
    return [(kind, key, keys.pointer(namespace, kind, key, rkey)) for kind, key in items]
