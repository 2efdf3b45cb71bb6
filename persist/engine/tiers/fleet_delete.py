"""A session deleted from the fleet, not only here: ``Store.delete(name, fleet=True)``,
``persist rm --fleet``.

A local delete is local: the fleet's session stays, and a new history this store
begins under the name is pushed beside it (``NAME~N``).  To replace the fleet's
session the user says so: each tier's session pointer is replaced by a
*tombstone* (``lineage.tombstone``) whose version is newer than every version
of the name this store knows and than the one the tier held, written only over
what was read there (a compare-and-set, as a push's).  This store records the
tombstone's version as seen: the next history it saves under the name takes
it, and an older version replayed on the tier is refused, here and by every
store that reads the tombstone; a machine still continuing the deleted history
pushes it beside (``NAME~N``), a conflict it reports.  A tombstone already in
place (another machine deleted the name first) is recorded as seen exactly as one
written here, so this store's next history under the name takes it; with nothing
here either, the name was deleted already (``SessionDeletedError``: ``rm --fleet``
run again after a partial failure says so and exits 0).  A tier that cannot be
asked fails the delete before anything here is deleted (try again: a tier that
already holds the tombstone is left as it is).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...remote.redis_tier import TierUnavailable
from ...storage import writes
from ...storage.index import Index
from .lineage import shown_url, tier_tokens, tombstone

__all__ = ["delete_everywhere", "Deleted"]

TRIES = 8  # tombstones that may lose the race for the pointer before the delete fails


class Deleted(NamedTuple):
    """What a fleet delete found: the tiers whose history of the name it replaced by a
    tombstone (``held``), and those where a tombstone was already (``gone``)."""

    held: list[str]
    gone: list[str]


def delete_everywhere(tiers: Sequence[Any], index: Index, namespace: str, name: str) -> Deleted:
    """Put a tombstone over session ``name`` on every tier that holds a history of it
    (``Deleted``).  TierUnavailable (naming the tier, saying nothing was deleted on
    the ones after it nor here) when one cannot be asked."""
    out = Deleted([], [])
    # the durable cold tier first, as a push: it decides the name, and with it down the
    # shared tier keeps its pointer (a Redis tombstone the cold tier lacks is half done)
    for shared in sorted(tiers, key=lambda t: t.name != "cold"):
        try:
            found = _tombstone(shared, index, namespace, name)
        except TierUnavailable as e:
            done = f" (it was on the {', '.join(out.held)} tier already)" if out.held else ""
            raise TierUnavailable(
                f"session {name!r} was not deleted{done}: the {shared.name} tier "
                f"({shown_url(shared.tier.url)}) could not be asked ({e}); nothing was "
                "deleted here, try again when it answers"
            ) from None
        if found is not None:
            (out.held if found else out.gone).append(shared.name)
    return out


def _tombstone(shared: Any, index: Index, namespace: str, name: str) -> bool | None:
    """One tier: its session ``name`` replaced by a tombstone (True); False where a
    tombstone was already (nothing to write); None where it held nothing of the name."""
    secret = shared.secret(index, namespace)
    if secret is None and shared.keys.key is None:
        shared.tier.get_secret(namespace)  # asks the tier: down is TierUnavailable
        return None  # no secret anywhere: the namespace holds nothing there
    for _ in range(TRIES):
        held = tier_tokens(shared.tier, shared.keys, namespace, name, secret)
        if held.rkey is None:
            if held.version is None:
                return None
            # another machine's tombstone: seen, as one written here (attack 38b, finding 13)
            index.saw(namespace, name, held.version)
            return False
        with index.read() as db:
            version = writes.version_after(db, namespace, name, time.time())
        version = max(version, (held.version or 0.0) + 1e-3)  # after the tier's, whatever
        mark = tombstone(shared.keys, namespace, name, version)  # the clocks say
        if shared.tier.swap_session(namespace, name.encode(), mark, held.token):
            index.saw(namespace, name, version)
            return True
    raise TierUnavailable(f"the session changed there under {TRIES} tries in a row")
