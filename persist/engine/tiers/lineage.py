"""One session name, one history fleet-wide: a push never replaces a tier's session with
one that does not continue it, and a tier that cannot be asked is never a "no such
session".

A machine that could not reach the shared tier used to start a new
conversation under a name the fleet already held, and its next push
replaced the fleet's pointer: every machine then resumed the one-turn fork.
Now a push first reads the tier's session of that name.  The snapshot takes
the name when the tier holds none (or a value that does not open), the same
record, a version this store saw (pushed or pulled: ``Index.seen``; a
version's time never goes back along its history, so an older one is one it
replaced knowingly), or one its tokens extend.  Any other is kept beside it
under the first ``NAME~N`` it continues or that is free, as a local save
keeps a turn that lost its race, and the push reports the conflict.  The check and the write
are two round trips, not one transaction: two machines pushing different
histories of one name within that window can still race (documented).
"""

from __future__ import annotations

from typing import Any

from ...errors import PersistError
from ...format.tokens import unpack_tokens
from .records import BadValue, Expect, Keys, open_record

__all__ = ["SessionUnreachableError", "MAX_FORKS", "kept_name", "shown_url", "tier_tokens"]

MAX_FORKS = 1000  # NAME~2 .. NAME~1000: past it a push fails rather than scan on


class SessionUnreachableError(PersistError, ConnectionError):
    """A named session this store does not hold, while a tier that may hold it could not
    be asked: continuing it would fork the fleet's history."""

    def __init__(self, session: str, namespace: str, tiers: list[str]) -> None:
        self.session, self.namespace, self.tiers = session, namespace, tiers
        super().__init__(
            f"session {session!r} is not in this store, and the {' and '.join(tiers)} "
            "that may hold it could not be asked; try again when it answers, or pass --new "
            "to start a new conversation (kept beside the fleet's, never over it)"
        )


def shown_url(url: str) -> str:
    """A tier's URL without its credentials (``redis://:PASSWORD@host``), for messages."""
    scheme, sep, rest = url.partition("://")
    host, at, path = rest.partition("/")
    return f"{scheme}{sep}{host.rpartition('@')[2]}{at}{path}"


def tier_tokens(
    tier: Any, keys: Keys, namespace: str, name: str, secret: bytes | None
) -> tuple[str, list[int], float] | None:
    """(record key, tokens, version) of the tier's session ``name``; None when it holds
    none, or a value that does not open (a hostile or damaged one is no history to keep)."""
    ptr = tier.pointers(namespace, [("sess", name.encode())])[0]
    if ptr is None:
        return None
    try:
        rkey = keys.open_pointer(namespace, "sess", name.encode(), ptr)
        value = tier.records(namespace, [rkey])[0]
        if value is None:
            return None
        body = open_record(keys, value, Expect(namespace, rkey, name=name, secret=secret))
    except BadValue:
        return None
    return rkey, unpack_tokens(body["row"]["tokens"]), float(body["row"]["created"])


def continues(
    tokens: list[int],
    held: tuple[str, list[int], float] | None,
    rkey: str,
    seen: float | None = None,
) -> bool:
    """Whether a snapshot (``tokens``, record ``rkey``) may take a name whose tier session
    is ``held``: none there, the same record, a version no newer than the latest this
    store saw of the name (``seen``), or one its tokens extend."""
    if held is None or held[0] == rkey or (seen is not None and held[2] <= seen):
        return True
    return tokens[: len(held[1])] == held[1]


def kept_name(
    tier: Any,
    keys: Keys,
    namespace: str,
    name: str,
    secret: bytes | None,
    tokens: list[int],
    rkey: str,
    seen: float | None = None,
) -> str:
    """The name this snapshot is pushed under: ``name`` if it continues the tier's session
    of that name (``seen``: the latest version of it this store saw before this push),
    else the first ``name~N`` (N >= 2) it continues or that is free."""
    if continues(tokens, tier_tokens(tier, keys, namespace, name, secret), rkey, seen):
        return name
    for n in range(2, MAX_FORKS + 1):
        other = f"{name}~{n}"
        if continues(tokens, tier_tokens(tier, keys, namespace, other, secret), rkey):
            return other
    raise BadValue("mismatched", f"more than {MAX_FORKS} histories of session {name!r}")
