"""A snapshot pushed to every tier under one name (the durable cold tier first), and
``persist sync``: every local snapshot pushed where a tier lacks it or holds it wrong,
then the named sessions pulled: where this store lacks them, or holds a past version
the fleet's continues (what each name came to is reported: ``_pull``).

The cold tier decides which name a session takes (its history, or its tombstone
after ``rm --fleet``, may make it a fork ``NAME~N``), and every later tier takes
that name too; a session whose cold push failed is held back from the others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ...storage.blobs import BlobStore
from ...storage.index import Index
from .fleet_plan import plan
from .push import Shared

__all__ = ["push_everywhere", "sync"]

log = logging.getLogger("persist")


def push_everywhere(
    tiers: Sequence[Shared],
    index: Index,
    blobs: BlobStore,
    namespace: str,
    sid: int,
    verify: bool = False,
) -> list[tuple[Shared, str]]:
    """Push one snapshot to every tier, the durable cold tier first, under one name:
    a session that one tier's history (or its tombstone: ``rm --fleet``) makes a
    fork, ``NAME~N``, is pushed as that fork to every later tier too.  A shared tier
    that lost everything (a Redis flush) would otherwise take it under the name the
    fleet deleted, and bring the deleted session back to every machine.  So a session
    whose cold push failed is ``held`` back from the later tiers (counted
    ``<tier>_held``): the name is the cold tier's to give, and a later sync or save
    pushes it once the cold tier answers.  Every tier's session of the name is read
    first (``fleet_plan``): the fleet's past on any tier is pushed to none, and a
    later tier's session the snapshot does not continue sends it beside on all.
    A snapshot without a name goes on; one whose name holds a value this machine
    cannot authenticate on any tier is ``refused`` on all, unless another tier
    vouches for this key (``fleet_plan``: then that value is replaced)."""
    ordered = sorted(tiers, key=lambda t: t.name != "cold")
    row = _row(index, sid)
    named = row is not None and row.role == "session" and row.name is not None
    p = plan(ordered, index, namespace, row) if named and len(ordered) > 1 else None
    if p is not None and p.verdict is not None:  # the fleet's own past, on some tier
        return [(tier, p.verdict) for tier in ordered]
    done: list[tuple[Shared, str]] = []
    fork: str | None = None
    unasked = False  # the cold tier could not be asked which name a session takes
    past: str | None = None  # the cold tier's "behind"/"deleted": the fleet's own past
    for i, tier in enumerate(ordered):
        if past is not None:  # a later tier (a flushed Redis) must not take it either
            done.append((tier, past))
            continue
        if unasked:
            index.count(namespace, **{f"{tier.name}_held": 1})
            (log.info if verify else log.warning)(  # sync reports it; a save says it here
                "persist: a session's push to the %s tier is held back until the cold "
                "tier answers (it decides the name); persist sync retries it",
                tier.name,
            )
            done.append((tier, "held"))
            continue
        forks = len(tier.conflicts)
        how = tier.push(
            index, blobs, namespace, sid, verify=verify, as_name=fork,
            base=p.base if p is not None and fork is None else None,
            beside=p is not None and p.beside and i == 0,
            replace_foreign=p is not None and tier.name in p.replace,
            live=p is not None and p.live,
        )  # fmt: skip
        if fork is None and len(tier.conflicts) > forks:  # pushed, or there already
            fork = tier.conflicts[-1][1]
        unasked = tier.name == "cold" and how == "failed" and named
        if tier.name == "cold" and how in ("behind", "deleted", "refused"):
            past = how
        done.append((tier, how))
    return done


def _row(index: Index, sid: int) -> Any:
    """Snapshot ``sid``'s index row; None where it is gone."""
    with index.read() as db:
        rows = Index.rows_where(db, "id = ?", [sid])
    return rows[0] if rows else None


def sync(
    index: Index,
    blobs: BlobStore,
    shared: Sequence[Shared],
    namespace: str | None,
    names: list[str],
) -> dict[str, Any]:
    """Push every local snapshot (of ``namespace``) to the tiers (each push reads what a
    tier holds of it and writes what it lacks or holds wrong), then pull the named
    sessions (``_pull``).  The report says what happened: per tier, snapshots
    pushed (a repaired one too), already there and right, failed, held back (a
    session waiting for the cold tier: ``push_everywhere``); conflicts, among them
    sessions not pushed because a tier holds a value under the name this machine
    cannot authenticate (``kept_as`` None, ``why``)."""
    rows = index.snapshots(namespace, named_only=False)
    per: dict[str, dict[str, int]] = {
        t.name: {"pushed": 0, "present": 0, "failed": 0, "held": 0} for t in shared
    }
    forked = {t.name: len(t.conflicts) for t in shared}
    refused = {t.name: len(t.refused) for t in shared}
    failed: set[int] = set()
    deleted: set[tuple[str, str]] = set()  # copies of sessions the fleet deleted: not pushed
    for row in rows:
        for tier, how in push_everywhere(shared, index, blobs, row.namespace, row.id, True):
            if how == "deleted" and row.name is not None:
                deleted.add((row.namespace, row.name))
            how = "pushed" if how == "conflict" else how  # written beside the tier's
            how = "present" if how == "behind" else how  # an older turn the tier holds
            if how in per[tier.name]:
                per[tier.name][how] += 1
            if how in ("failed", "held"):  # held: waits for the cold tier, retried
                failed.add(row.id)
    got = _pull(index, blobs, shared, namespace or "default", names, deleted)
    total = {k: sum(p[k] for p in per.values()) for k in ("pushed", "present", "failed", "held")}
    conflicts: list[dict[str, Any]] = [
        {"tier": t.name, "session": a, "kept_as": b} for t in shared
        for a, b in t.conflicts[forked[t.name]:]
    ]  # fmt: skip
    conflicts += [  # not pushed: the tier's value there is not authenticated here
        {"tier": t.name, "session": a, "kept_as": None, "why": why} for t in shared
        for a, why in t.refused[refused[t.name]:]
    ]  # fmt: skip
    return {
        **total,
        "conflicts": conflicts,
        "snapshots": len(rows),
        "snapshots_failed": len(failed),
        "tiers": per,
        **got,
        "deleted_on_fleet": sorted({n for _, n in deleted}),
    }


def _pull(
    index: Index,
    blobs: BlobStore,
    shared: Sequence[Shared],
    ns: str,
    names: list[str],
    deleted: set[tuple[str, str]],
) -> dict[str, Any]:
    """Each named session: ``pulled`` only where this run fetched the fleet's version
    (attack 38e, F1: a local copy was reported pulled), ``up_to_date`` where this store
    holds exactly it, ``kept_here`` where this store's own history of the name differs
    from it, ``unreached`` where a tier that may hold it could not be asked (also with a
    local copy), ``unreadable`` where a tier names it and it cannot be read here,
    ``missing`` where no tier holds it.  A local copy of a session the fleet deleted
    (the push found its tombstone) is reported as deleted only, by the caller."""
    out: dict[str, list[str]] = {
        k: [] for k in ("pulled", "up_to_date", "kept_here", "unreached", "missing")
    }
    unreadable: dict[str, str] = {}  # a tier names it, this machine cannot read it: why
    for name in names:
        have = index.by_name(ns, name)
        if have is not None and (ns, name) in deleted:
            continue
        what, why = _pull_one(index, blobs, shared, ns, name, have)
        if what == "unreadable" and why is not None:  # as restore's SessionUnreadableError
            unreadable[name] = why
        elif name not in out[what]:
            out[what].append(name)
    return {**{k: sorted(v) for k, v in out.items()}, "unreadable": unreadable}


def _pull_one(
    index: Index, blobs: BlobStore, shared: Sequence[Shared], ns: str, name: str, have: Any
) -> tuple[str, str | None]:
    """One name's outcome (a key of ``_pull``'s report) and, if unreadable, why.  With a
    local copy every tier is asked: the one that cannot be asked may hold the fleet's
    latest (the cold tier decides a name), so it is ``unreached``, never a success."""
    down, why, verdicts = False, None, set()
    for tier in shared:
        if have is None and index.by_name(ns, name) is not None:
            break  # pulled from an earlier tier
        before = tier.unreachable
        if tier.pull_session(index, blobs, ns, name, over=have):
            return "pulled", None
        down = down or tier.unreachable > before
        why = why or tier.unread or tier.replay_why()  # a replay: named there (38f, F3)
        verdicts.add(tier.held_here)
    if down:  # a tier that could not be asked: a failure, not "not in any tier"
        return "unreached", None
    if why is not None:  # as restore's SessionUnreadableError (attack 38c, finding 3)
        return "unreadable", why
    # "newer" not pulled: a save here took the name during the pull (attack 38f, F3)
    if verdicts & {"other", "newer"}:
        return "kept_here", None
    if "same" in verdicts:
        return "up_to_date", None
    if have is None and index.by_name(ns, name) is not None:
        return "pulled", None
    return "missing", None
