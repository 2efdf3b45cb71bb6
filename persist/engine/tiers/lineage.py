"""One session name, one history fleet-wide: a push never replaces a tier's session with
one that does not continue it, and a tier that cannot be asked is never a "no such
session".

A machine that could not reach the shared tier used to start a new
conversation under a name the fleet already held, and its next push
replaced the fleet's pointer: every machine then resumed the one-turn fork.
Now a push first reads the tier's session of that name.  The snapshot takes
the name when the tier holds none (or a value that does not open), the same
record, a record its tokens extend, or a tombstone no newer than the latest
version this store's own history of the name continues (pushed or pulled and
not deleted here since: ``Index.base``): a fleet delete it moved past.  A
record is judged by its tokens alone, never by its version: versions are save
times from every machine's clock, and a record older than ``base`` that the
snapshot does not extend (from a machine whose clock is behind, or planted with
an old version) is another history all the same; taking the name by version
replaced it, a fork lost fleet-wide (attack 38d).  Any other is kept beside it
under the first ``NAME~N`` it continues or that is free, as a local save keeps
a turn that lost its race, and the push reports the conflict.  So a different
conversation saved under a name, even over this store's own pushed session, goes
beside it: only ``rm --fleet`` (a tombstone) gives the name to a new history.

The pointer is then written only over the value the push read (a
compare-and-set: ``remote/pointer_swap``); a push that finds another there
(a machine that pushed in between) reads and decides again, so two machines
racing with different histories of one name keep both.  A local delete
forgets the base, not the versions seen: a new history under the name goes
beside the fleet's, and an older version replayed stays refused.  A fleet
delete (``persist rm --fleet``, ``fleet_delete``) puts a *tombstone* in the
pointer's place, a version newer than every one it replaces: a store that saw
it (its writer, a reader that found it) takes the name with its next history,
a store whose history of the name is older is kept beside it.

A value under the name that this machine cannot authenticate (tagged under another
operator key, under none, or forged: ``Held.foreign``) is no "nothing there": it may
be the fleet's history under the fleet's key, and this machine the one with the wrong
key (attack 38b, finding 5).  A push refuses it (``Foreign``), never writes over it
nor beside it (a ``NAME~N`` under a key the fleet cannot read serves no one), unless
told this machine's key is the fleet's: ``rekey`` (a rotation, ``persist sync
--rekey``), where the lineage such a value states (its tokens, version, tombstone
version, read without its tag: ``tier_tokens(peek=True)``) is judged as any other's,
so the rotation replaces only what the snapshot continues and goes beside or pushes
nothing otherwise (attack 38c, finding 1), and is used for nothing else; or
``replace``, where another tier authenticates the name's history under this key
(``fleet_plan``): the value is a plant, and free (attack 38c, finding 4).  A pointer
whose own tag is stripped or forged but whose record opens and authenticates under
this key as the name's is not foreign to a push (``tier_tokens(by_record=True)``,
``Held.stripped``): that record's lineage decides, as an authenticated pointer's would
(finding D); ``fleet_plan`` says when such a pointer is written over.  A tombstone,
or a record that does not authenticate (a keyless fleet's, another key's), stays
foreign.  A pull still reads nothing through a pointer without a valid tag (its
repair only declines to write an older version over one: ``stale_held``).
"""

from __future__ import annotations

import hmac
import math
import struct
from typing import Any, NamedTuple

from ...errors import PersistError, SessionUnreachableError
from ...format.tokens import unpack_tokens
from ...remote.urls import shown_url
from ...storage.rows import MAX_FORKS, fork_name  # past MAX_FORKS a push fails, not scans on
from .records import BadValue, Expect, Keys, open_record

__all__ = [
    "SessionUnreachableError", "MAX_FORKS", "Held", "kept_name", "shown_url", "tier_tokens",
    "tombstone", "open_tombstone", "RepairDeclined", "stale_held", "past", "continues",
    "Foreign", "forked", "holds_copy",
]  # fmt: skip


class Foreign(PersistError):
    """A push that found, under ``name``, a tier value this machine cannot authenticate
    (``detail``): not written over (``tier_tokens``, ``Held.foreign``)."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"session {name!r}: {detail}")
        self.name, self.detail = name, detail


class RepairDeclined(PersistError):
    """A stale session pointer left as it is: the tier no longer holds the value the
    repair read (a newer push got there first), or a version no older than the one
    the repair would write (``stale_held``)."""


class Held(NamedTuple):
    """The tier's session pointer of a name, as a push reads it."""

    token: Any  # what the pointer's compare-and-set expects (``swap_session``)
    rkey: str | None  # the record it names; None: none, a tombstone, or one that does not open
    tokens: list[int] | None  # that record's tokens; None: no history there
    version: float | None  # its version (save time), or the tombstone's; None: neither
    value: bytes | None = None  # the pointer's bytes as read (a repair compares them)
    foreign: str | None = None  # why a value there cannot be authenticated here: not replaced
    stripped: str | None = None  # why the pointer is not, while its record is (``by_record``)


def tier_tokens(
    tier: Any,
    keys: Keys,
    namespace: str,
    name: str,
    secret: bytes | None,
    peek: bool = False,
    by_record: bool = False,
) -> Held:
    """The tier's session ``name``: its record's key, tokens and version, a tombstone's
    version (``persist rm --fleet``), or nothing (also a value that does not open: a
    damaged one is no history to keep); with the pointer's token.  A pointer, tombstone
    or record that is well formed but not authenticated under this machine's key (or,
    without a key, tagged under one) is ``foreign``: the fleet's, maybe, under a key
    this machine lacks.  ``by_record`` (a push's reads): a pointer not authenticated
    whose record is, under this key and as this name's, is that record's lineage,
    ``stripped`` (``_own_record``).  ``peek``: a foreign value's lineage too, read
    without its tag (``_peeked``), for a rotation's push (``rekey``), which may replace
    such a value but must still not replace a newer history or a tombstone with an
    older copy."""
    value, token = tier.session_pointer(namespace, name.encode())
    nothing = Held(token, None, None, None, value)
    if value is None:
        return nothing
    try:
        gone = open_tombstone(keys, namespace, name, value)
        if gone is not None:
            _untagged(keys, value)
            return Held(token, None, None, gone, value)
        rkey = keys.open_pointer(namespace, "sess", name.encode(), value)
        _untagged(keys, value)
        got = _lineage(
            tier, keys, namespace, rkey, Expect(namespace, rkey, name=name, secret=secret)
        )
        if got is None:
            return nothing
    except BadValue as e:
        if e.why != "unauthenticated":
            return nothing
        own = _own_record(tier, keys, namespace, name, secret, value) if by_record else None
        if own is not None:
            return own._replace(token=token, stripped=e.detail)
        if peek:
            return _peeked(tier, keys, namespace, name, nothing._replace(foreign=e.detail))
        return nothing._replace(foreign=e.detail)
    return Held(token, rkey, got[0], got[1], value)


def _lineage(
    tier: Any, keys: Keys, namespace: str, rkey: str, want: Expect, authenticated: bool = True
) -> tuple[list[int], float] | None:
    """Record ``rkey``'s tokens and version, opened as ``want`` says (BadValue where it
    does not open); None where the tier holds no such record."""
    record = tier.records(namespace, [rkey])[0]
    if record is None:
        return None
    body = open_record(keys, record, want, authenticated=authenticated)
    return unpack_tokens(body["row"]["tokens"]), float(body["row"]["created"])


def _own_record(
    tier: Any, keys: Keys, namespace: str, name: str, secret: bytes | None, value: bytes
) -> Held | None:
    """The lineage of the record a pointer without a valid tag names, where that record
    opens and authenticates under this machine's key as session ``name``'s (finding D:
    a tag stripped off the cold tier's pointer refused every keyed push, for good).
    Only a writer with the key made that record, and only as this name's: the name's
    history is this key's, and the pointer is judged by it as any authenticated one,
    written over only as ``fleet_plan.left_stripped`` allows.  None without a key (a
    keyless machine authenticates nothing), for a tombstone, a pointer whose own tag is
    valid (its record failed), and a record that is gone or does not authenticate: a
    keyless fleet's, another key's."""
    if keys.key is None or value.startswith(b"~"):
        return None
    try:
        keys.open_pointer(namespace, "sess", name.encode(), value)
        return None  # the pointer is this key's: its record is what failed
    except BadValue as e:
        if e.why != "unauthenticated":
            return None
    rkey = value.partition(b".")[0].decode("ascii")  # open_pointer checked its form
    try:
        got = _lineage(
            tier, keys, namespace, rkey, Expect(namespace, rkey, name=name, secret=secret)
        )
    except BadValue:
        return None
    return None if got is None else Held(None, rkey, got[0], got[1], value)


def _peeked(tier: Any, keys: Keys, namespace: str, name: str, held: Held) -> Held:
    """``held`` (a foreign value) with the lineage it states: its tombstone's version, or
    its record's key, tokens and version, read without checking a tag (attack 38c,
    finding 1: a rotation that took the old key's values for "nothing there" replaced
    their newer turns and tombstones).  Still ``foreign``: whoever wrote it could have
    written anything, so it may only make a push push less or go beside, never be
    pulled, repaired from or carried.  A value that does not parse: as it was."""
    value = held.value or b""
    mark = value.partition(b".")[0]
    try:
        if mark.startswith(b"~"):
            version = struct.unpack(">d", bytes.fromhex(mark[1:].decode("ascii")))[0]
            ok = math.isfinite(version) and version > 0
            return held._replace(version=float(version)) if ok else held
        rkey = mark.decode("ascii")
        if len(rkey) != 32 or any(c not in "0123456789abcdef" for c in rkey):
            return held
        want = Expect(namespace, rkey, name=name)  # its chains are under the other key's
        got = _lineage(tier, keys, namespace, rkey, want, authenticated=False)
        if got is None:
            return held
    except (ValueError, struct.error, BadValue):
        return held
    return held._replace(rkey=rkey, tokens=got[0], version=got[1])


def _untagged(keys: Keys, value: bytes) -> None:
    """Without a key, a pointer or tombstone carrying a tag (``.`` and hex after the
    record key or version) is a keyed writer's: BadValue, ``unauthenticated``."""
    if keys.key is None and b"." in value:
        raise BadValue("unauthenticated", "a value tagged with an operator key")


def continues(tokens: list[int], held: Held, rkey: str, base: float | None = None) -> bool:
    """Whether a snapshot (``tokens``, record ``rkey``) may take a name whose tier session
    is ``held``: none there, the same record, a record its tokens extend, or a tombstone
    no newer than the latest version this store's history of the name continues
    (``base``).  A record's version never decides: versions are save times of other
    machines' clocks, and a record older than ``base`` that the tokens do not extend is
    another history all the same (attack 38d: such a record was replaced, a fork lost)."""
    if held.version is None or held.rkey == rkey:
        return True
    if held.rkey is None:  # a tombstone: a fleet delete this history moved past, or not
        return base is not None and held.version <= base
    return held.tokens is not None and tokens[: len(held.tokens)] == held.tokens


def past(
    held: Held, row: Any, base: float | None, seen: float | None, live: bool = False
) -> str | None:
    """Whether ``row`` is the fleet's past where a tier holds ``held``.  Only a version
    this store pushed or pulled and saved nothing on (at or below ``base``) qualifies:
    ``behind`` where the tier's session is a newer version whose tokens extend it (a
    machine that merely did not pull the later turns); ``deleted`` where it is a
    tombstone no older than it (``rm --fleet``), a newer history that does not extend
    it (a new conversation after a tombstone: the fleet replaced it knowingly), or
    where this store saw a version newer than the copy (``seen``: a tombstone it read)
    and the tier holds nothing as new (a tier that came back empty or rolled back
    cannot prove the delete undone).  Pushing any of these back, even as ``NAME~2``,
    would bring a conversation the fleet moved past back to it.

    ``live``: another tier still holds this copy's history under the name
    (``holds_copy``).  A newer history that does not extend it is then a fork, not a
    delete (a tier that lost the pointer, and a machine without the other tier that
    started a conversation there: attack 38c, finding 2), unless this store saw a
    version newer than the copy: None, the copy is pushed (beside, a conflict)."""
    created = float(row.created)
    if base is None or created > base:
        return None
    if held.version is not None and held.version > created and held.rkey is not None:
        toks = unpack_tokens(row.tokens)
        if held.tokens is not None and held.tokens[: len(toks)] == toks:
            return "behind"
        return None if live and (seen is None or seen <= created) else "deleted"
    if held.version is not None and held.rkey is None and held.version >= created:
        return "deleted"  # a tombstone (a value that does not open has no version)
    return "deleted" if seen is not None and seen > created else None


def holds_copy(held: Held, row: Any) -> bool:
    """Whether a tier's session ``held`` is snapshot ``row``'s own history: a record (not
    a tombstone) no newer than it whose tokens it extends, e.g. the very version."""
    if held.rkey is None or held.tokens is None or held.version is None:
        return False
    toks = unpack_tokens(row.tokens)
    return held.version <= float(row.created) and toks[: len(held.tokens)] == held.tokens


def forked(one: Held, other: Held) -> bool:
    """Whether two tiers' sessions of a name are two histories: both records, and the
    newer one's tokens do not extend the older one's (equal versions: unequal tokens).
    A tombstone, nothing, or a value that does not open is no fork: lineage by version
    decides there (a newer record follows an older tombstone, a newer tombstone deletes)."""
    if one.version is None or other.version is None:
        return False
    old, new = sorted((one, other), key=lambda h: h.version or 0.0)
    if old.tokens is None or new.tokens is None:
        return False
    return new.tokens[: len(old.tokens)] != old.tokens


def kept_name(
    tier: Any,
    keys: Keys,
    namespace: str,
    name: str,
    *,
    secret: bytes | None,
    tokens: list[int],
    rkey: str,
    base: float | None = None,
    beside: bool = False,
    rekey: bool = False,
    replace: bool = False,
) -> tuple[str, Held]:
    """The name this snapshot is pushed under, and what the tier holds there: ``name``
    if it continues the tier's session of that name (``continues``: a record by its
    tokens, a tombstone by ``base``, ``Index.base`` read before this push) and not
    ``beside`` (another tier's session of the name it does not continue:
    ``fleet_sync``), else the first ``name~N`` (N >= 2, ``rows.fork_name``) it continues
    or that is free. A value under ``name`` this machine cannot authenticate is
    ``Foreign`` (one under a ``name~N`` is passed over), unless ``rekey``: then the
    lineage it states (read without its tag) decides, as any other's does: a history the
    snapshot does not continue keeps the name, the snapshot goes beside (attack 38c,
    finding 1); or ``replace`` (another tier vouched for this key: ``fleet_plan``): then
    it is a planted value, free (attack 38c, finding 4). A pointer whose tag was
    stripped or forged but whose record authenticates here is that record's lineage
    (``stripped``: ``by_record``), judged as an authenticated one (finding D)."""
    held = tier_tokens(tier, keys, namespace, name, secret, peek=rekey, by_record=True)
    if held.foreign is not None and not (rekey or replace):
        raise Foreign(name, held.foreign)
    if not beside and continues(tokens, held, rkey, base):
        return name, held
    for n in range(2, MAX_FORKS + 1):
        other = fork_name(name, n)  # a name every command takes (attack 38d, finding E)
        if other == name:
            continue
        held = tier_tokens(tier, keys, namespace, other, secret, peek=rekey, by_record=True)
        if (held.foreign is None or rekey or replace) and continues(tokens, held, rkey):
            return other, held
    raise BadValue("mismatched", f"more than {MAX_FORKS} histories of session {name!r}")


def stale_held(
    tier: Any,
    keys: Keys,
    namespace: str,
    name: str,
    *,
    secret: bytes | None,
    stale: bytes | None,
    version: float,
    tokens: list[int] | None = None,
    rkey: str | None = None,
) -> Held:
    """The tier's session ``name`` if a repair may write over it: it still holds exactly
    ``stale`` (the value a named pull read there and found behind the cold tier's),
    and no version as new as ``version`` (the cold tier's, which the repair writes),
    and, given the ``tokens`` the repair writes, no history they do not extend (a
    fork: both are kept, never one repaired over the other); else RepairDeclined.
    The write that follows is a compare-and-set over the same value, so a push
    landing after this read declines the repair there too.  A pointer whose tag was
    stripped is judged by its record where that authenticates here (``by_record``):
    a newer one is not written back to the other tier's older turn (a rollback made
    authentic), the very record ``rkey`` is (the other tier's pointer tags it)."""
    held = tier_tokens(tier, keys, namespace, name, secret, by_record=True)
    if held.value != stale:  # the bytes (a cold tier's token is its ETag)
        raise RepairDeclined(f"session {name!r} moved on the tier since it was read")
    retag = held.stripped is not None and rkey is not None and held.rkey == rkey
    if held.version is not None and held.version >= version and not retag:
        raise RepairDeclined(f"the tier's session {name!r} is no older than the cold tier's")
    if tokens is not None and held.tokens is not None and tokens[: len(held.tokens)] != held.tokens:
        raise RepairDeclined(f"the tier's session {name!r} is another history (a fork)")
    return held


def tombstone(keys: Keys, namespace: str, name: str, version: float) -> bytes:
    """A session pointer that says the fleet deleted ``name`` at ``version``: ``~`` and
    the version's 8 bytes (IEEE double, hex), with a key tagged as any pointer is."""
    mark = "~" + struct.pack(">d", version).hex()
    return keys.pointer(namespace, "sess", name.encode(), mark)


def open_tombstone(keys: Keys, namespace: str, name: str, value: Any) -> float | None:
    """The version of a tombstone (``tombstone``); None for a value that is not one;
    BadValue for one that does not open (with a key: a valid tag, or no tombstone)."""
    if not isinstance(value, bytes) or not value.startswith(b"~"):
        return None
    mark = value.partition(b".")[0].decode("ascii", "replace")
    try:
        version = float(struct.unpack(">d", bytes.fromhex(mark[1:]))[0])
    except (ValueError, struct.error):
        raise BadValue("malformed", "a tombstone without its version") from None
    if keys.key is not None and not hmac.compare_digest(
        keys.pointer(namespace, "sess", name.encode(), mark), value
    ):
        raise BadValue("unauthenticated", "a tombstone without a valid tag")
    if not (math.isfinite(version) and version > 0):
        raise BadValue("malformed", "a tombstone whose version is not a time")
    return version
