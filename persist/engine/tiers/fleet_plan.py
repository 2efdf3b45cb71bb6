"""What every tier holds of a session's name, read before the session is pushed to any:
one tier's answer is every tier's.

The cold tier decides a session's name and every later tier takes it
(``fleet_sync.push_everywhere``).  Deciding on the cold tier's pointer alone went
wrong wherever the tiers disagree (attack 38b): a cold tier rolled back to an
older version, or one that a machine with only ``--shared`` never wrote, let a
push replace Redis's newer turn or tombstone without a conflict (the cold push
raised ``Index.base``, and Redis's check then read that); a cold tier that came
back empty after ``rm --fleet`` took the deleted session back under its name;
and a copy pulled before a fleet delete went back beside the next conversation
as ``NAME~2``.  So a named session's push first reads each tier's session of the
name (one pointer and one record per tier) and decides once:

- the copy is the fleet's past on any tier (``lineage.past``: behind a newer
  version, under a tombstone, replaced by a newer history (unless a tier still
  holds the copy's own history, ``live``: then that newer history is a fork, and
  the copy goes beside it; attack 38c, finding 2), or older than a
  version this store saw while a tier holds nothing as new): pushed to none.  A
  tombstone found is recorded as seen (the replay floor, not the base: a turn
  saved on this copy does not continue the tombstone), and put by compare-and-set
  on a tier that answered with nothing or an older version: a tier that comes back
  empty cannot prove a delete undone, so the other tier's tombstone holds;
- a later tier holds a session of the name this snapshot does not continue (a
  record its tokens do not extend, however old its version, or a newer tombstone
  the cold tier lacks): the snapshot goes beside it on every tier, ``NAME~N``, a
  conflict reported;
- every tier's push judges the name against ``Index.base`` as it was before the
  first one;
- a tier holds a value under the name that this machine cannot authenticate
  (another operator key's, none, forged: ``Held.foreign``): pushed to none, a
  conflict on each such tier (``Shared.refuse``), unless the tier is told this
  machine's key is the fleet's (``rekey``: a rotation), or the cold tier
  *vouches* for it: it authenticates, under this key, a session of the name (a
  record or tombstone) that this store's history knew (at or below ``Index.base``)
  or that the snapshot's tokens extend (``_vouched``).  Then the key is evidently the fleet's for
  that name, and the foreign value one planted by a writer without it (attack
  38c, finding 4: a tag stripped off Redis's pointer stopped the push to every
  tier): it decides nothing (a forged tombstone or history would otherwise send
  the fleet's turn beside) and is replaced (``replace``: counted
  ``<tier>_foreign_replaced``).  A machine with the wrong key finds nothing it
  authenticates, and is refused as before;
- a pointer whose tag was stripped or forged but whose record authenticates under
  this key as the name's (``Held.stripped``: ``tier_tokens(by_record=True)``) is
  not foreign: only a writer with the key made that record, so its lineage is
  judged as an authenticated pointer's, on any tier, the cold one included
  (finding D: a tag stripped off the cold tier's pointer refused every keyed
  push of the name, for good).  But a writer without the key may have pointed
  the name back at an older record (the cold tier keeps every record), so such a
  pointer is written over only by a *turn* saved here since this store last
  pushed or pulled the name, where the turn continues it (counted
  ``<tier>_foreign_replaced``), or by a copy another tier's pointer names tagged
  (``_witnessed``); a copy alone leaves it as it is (``left_stripped``: re-tagged
  or moved on to the copy, an older record would be an authentic rollback), and a
  stripped cold pointer vouches for a turn only;
- under ``rekey`` a foreign value's lineage (read without its tag:
  ``tier_tokens(peek=True)``) is judged as any other's (attack 38c, finding 1: a
  rotation replaced the old key's newer turns and tombstones): it may make the
  push go beside (a fork, a conflict), never anything more (its tombstone is
  not carried to other tiers, nor recorded as seen); where it alone says the
  fleet moved past the copy (a tombstone, a newer turn), the copy is pushed to no
  tier and each such tier reports a conflict (``Shared.refuse(rotating=True)``):
  a key that cannot authenticate it cannot tell the old key's delete from one
  planted by a writer without a key (attack 38f, finding 1: one forged tombstone on
  Redis made every rotation call a live session "deleted", exit 0, and advise
  ``persist rm``).
A tier that cannot be asked says nothing here; its push fails or is held back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...format.tokens import unpack_tokens
from ...remote.redis_tier import TierUnavailable
from ...storage.index import Index
from .lineage import Held, continues, holds_copy, past, shown_url, tier_tokens

__all__ = ["Plan", "plan", "refused_first", "left_stripped"]

log = logging.getLogger("persist")
NOTHING = Held(None, None, None, None)  # what this store itself saw (``seen``) decides alone


class Plan(NamedTuple):
    base: tuple[float | None]  # Index.base of the name before any tier's push
    verdict: str | None  # "behind" / "deleted" (the fleet's past) / "refused": to no tier
    beside: bool  # a later tier's session of the name it does not continue: NAME~N
    replace: frozenset[str] = frozenset()  # tiers whose foreign value another vouched out
    live: bool = False  # a tier holds this copy's own history: another one is a fork


def plan(tiers: Sequence[Any], index: Index, namespace: str, row: Any) -> Plan:
    """The decision for named session ``row`` over ``tiers`` (the cold tier first)."""
    name = str(row.name)
    base, seen = index.base(namespace, name), index.seen(namespace, name)
    toks = unpack_tokens(row.tokens)
    helds = [(tier, _held(tier, index, namespace, name)) for tier in tiers]
    answered = [(t, h) for t, h in helds if h is not None]
    foreign = [(t, h.foreign) for t, h in answered if h.foreign is not None and not t.rekey]
    turn = base is None or float(row.created) > base  # saved here since, not a copy
    cold = [(t, h) for t, h in answered if t.name == "cold"]
    if foreign and not _vouched(cold, toks, base, turn):
        for tier, why in foreign:  # maybe the fleet's session, under a key this one is not
            tier.refuse(index, namespace, name, why)
        return Plan((base,), "refused", False)
    # vouched for: a foreign value is a plant, judged by nothing (rekey: the old key's)
    answered = [(t, h) for t, h in answered if h.foreign is None or t.rekey]
    live = any(holds_copy(h, row) for _, h in answered)  # another history is a fork then
    trusted = [NOTHING, *(h for _, h in answered if h.foreign is None)]  # NOTHING: ``seen``
    verdict = _verdict(trusted, row, base, seen, live)
    doubted = [(t, h) for t, h in answered if h.foreign is not None]  # rekey: read untagged
    stops = [
        (t, h) for t, h in doubted if verdict is None and _stops(h, row, toks, base, seen, live)
    ]
    if stops:
        # only a value no key here authenticates says the fleet moved past this copy or
        # deleted the name: the old key's word, or a plant (attack 38f, finding 1: a forged
        # tombstone made every rotation call a live session deleted, exit 0, or push its
        # next turn beside): asked, not taken
        for tier, h in stops:
            what = "a tombstone" if h.rkey is None else "a newer turn of it"
            tier.refuse(index, namespace, name, f"{what} no key here authenticates", True)
        return Plan((base,), "refused", False)
    if verdict == "deleted":
        _carry_tombstone(answered, index, namespace, name, float(row.created))
    later = [h for t, h in answered if t is not tiers[0]]  # the first decides the name
    beside = verdict is None and any(not continues(toks, h, "", base) for h in later)
    replace = {t.name for t, _ in foreign} | _witnessed(answered, row, toks)
    return Plan((base,), verdict, beside, frozenset(replace), live)


def _stops(
    h: Held, row: Any, toks: list[int], base: float | None, seen: float | None, live: bool
) -> bool:
    """Whether a value read without its tag (a rotation's) would keep ``row`` off the
    tier: it makes the copy the fleet's past, or it is a tombstone the copy does not
    continue (a history of another conversation still goes beside: a fork, reported)."""
    if past(h, row, base, seen, live) is not None:
        return True
    return h.rkey is None and h.version is not None and not continues(toks, h, "", base)


def _verdict(
    helds: list[Held], row: Any, base: float | None, seen: float | None, live: bool
) -> str | None:
    """``deleted`` or ``behind`` if any of ``helds`` says the fleet moved past ``row``
    (``lineage.past``), ``deleted`` first; else None (push it)."""
    verdicts = {past(h, row, base, seen, live) for h in helds}
    return "deleted" if "deleted" in verdicts else "behind" if "behind" in verdicts else None


def _witnessed(answered: list[tuple[Any, Held]], row: Any, toks: list[int]) -> set[str]:
    """Tiers whose pointer has its tag stripped (``Held.stripped``) where another tier's
    pointer names this very copy tagged: a copy is pushed over a stripped pointer only
    so (a writer with those bytes could have put them there itself); otherwise only a
    turn saved here since moves such a pointer on (``left_stripped``)."""
    created = float(row.created)
    tagged = any(
        h.stripped is None and h.rkey is not None and h.version == created and h.tokens == toks
        for _, h in answered
    )
    return {t.name for t, h in answered if h.stripped is not None} if tagged else set()


def _vouched(cold: list[tuple[Any, Held]], toks: list[int], base: float | None, turn: bool) -> bool:
    """Whether the cold tier authenticates, under this machine's key, a session of the
    name (a record or a tombstone) that this store's history knew (a version at or
    below ``base``) or the snapshot's tokens extend: the key is the fleet's for this
    name.  Evidence of the key, not lineage: a record at or below ``base`` that the
    snapshot does not extend still vouches, and the snapshot goes beside it
    (``kept_name``; attack 38d) rather than be refused for a plant.  Nothing there,
    or a value this key cannot open, vouches for nothing (a wrong key is refused).
    Only the cold tier, which decides names and evicts nothing: a wrong-keyed machine
    that once pushed alone to Redis (``--shared`` only, the fleet's pointer evicted)
    found its own session there and replaced the fleet's cold pointer.  A pointer
    whose tag was stripped (its record authenticates: ``Held.stripped``) vouches only
    for a ``turn`` saved here since: a writer without the key may have pointed the name
    back at an older record, and a copy pushed over another tier's plant would make
    that rollback authentic there (finding D)."""
    return any(
        h.foreign is None
        and h.version is not None
        and (h.stripped is None or turn)
        and ((base is not None and h.version <= base) or continues(toks, h, "", base))
        for _, h in cold
    )


def _held(tier: Any, index: Index, namespace: str, name: str) -> Held | None:
    """The tier's session ``name`` (under rekey, a foreign value's lineage too); None
    where the tier cannot be asked."""
    secret = tier.secret(index, namespace)  # a tier that is down: what it was, or None
    try:
        return tier_tokens(
            tier.tier, tier.keys, namespace, name, secret, peek=tier.rekey, by_record=True
        )
    except TierUnavailable:
        return None


def _carry_tombstone(
    answered: list[tuple[Any, Held]], index: Index, namespace: str, name: str, copy: float
) -> None:
    """The newest tombstone among the tiers' answers seen here, and put on each tier that
    answered with nothing, an older tombstone, or a version no newer than this store's
    copy of the deleted history (``copy``: a tier rolled back to it); a compare-and-set
    over what it read.  A newer history there, or a value that does not open, stays."""
    stones = [  # a foreign one's version says only "push less": not carried, not seen
        h for _, h in answered if h.rkey is None and h.version is not None and h.foreign is None
    ]
    if not stones:
        return
    newest = max(stones, key=lambda h: h.version or 0.0)
    if newest.version is None or newest.value is None:
        return
    index.saw(namespace, name, newest.version, base=False)
    for tier, h in answered:
        lagging = h.value is None or (h.version is not None and h.version < newest.version)
        if not lagging or (h.rkey is not None and (h.version or 0.0) > copy):
            continue
        try:
            done = tier.tier.swap_session(namespace, name.encode(), newest.value, h.token)
        except TierUnavailable:
            continue
        index.count(namespace, **{f"{tier.name}_{'repaired' if done else 'repair_declined'}": 1})
        if done:
            log.info("persist: %s tier's session %r set to the fleet's tombstone", tier.name, name)


def refused_first(
    shared: Any, index: Index, namespace: str, sid: int, name: str | None, replace: bool
) -> bool:
    """Whether named snapshot ``sid``'s name (``name``: the ``NAME~N`` it is pushed as)
    holds, on ``shared``'s tier, a value this machine cannot authenticate: refused
    (``Shared.refuse``) before the push writes anything.  A keyless machine in a keyed
    fleet wrote its own namespace secret to the tier before its push was refused
    (attack 38b, finding 5).  False under rekey or ``replace`` (``plan``), and where
    the tier is down (the push fails on its own)."""
    if shared.rekey or replace:
        return False
    with index.read() as db:
        rows = Index.rows_where(db, "id = ?", [sid])
    if not rows or rows[0].role != "session" or rows[0].name is None:
        return False
    name, secret = name or str(rows[0].name), shared.secret(index, namespace)
    try:
        held = tier_tokens(shared.tier, shared.keys, namespace, name, secret, by_record=True)
    except TierUnavailable:
        return False
    if held.foreign is None:
        return False
    shared.refuse(index, namespace, name, held.foreign)
    return True


def left_stripped(tier: Any, held: Held, name: str, moves: bool) -> bool:
    """Whether a push leaves the tier's session pointer ``held`` of ``name`` as it is: its
    tag stripped or forged, its record this key's (``Held.stripped``), and the push no
    ``moves`` (a turn saved here since, or a copy another tier names tagged:
    ``_witnessed``).  A writer without the key may have pointed the name back at an older
    record, and this machine, holding an older copy too, cannot tell: a tag written over
    it would make that rollback authentic to every reader (finding D)."""
    if held.stripped is None or moves:
        return False
    log.warning(
        "persist: %s's session pointer %r has no valid tag (a writer without the operator "
        "key changed it); left as it is: a copy is not pushed over it, the next turn "
        "saved here replaces it",
        shown_url(tier.url), name,
    )  # fmt: skip
    return True
