"""Unverified tokens: a session whose tokens are the caller's word (an imported
purely recurrent cache records no offset), and everything continued from it."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar, cast

import msgpack

from ..errors import InvalidArgumentError
from ..format.tokens import unpack_tokens
from ..marks import carries_unverified
from ..storage import writes

__all__ = ["UNVERIFIED_KEY", "inherits_unverified", "inherit_mark", "marked"]

UNVERIFIED_KEY = "persist.unverified_tokens"  # session metadata: the session is unverified


def inherits_unverified(db: Any, namespace: str, name: str, toks: list[int]) -> bool:
    """A session continued from unverified tokens stays unverified, and so does a
    checkpoint it owns: their tokens still begin with what nothing checked.

    An unverified row has a floor above its length (``min_resume`` = n_tokens +
    1): the resume policy then lets no lookup take any prefix of it, here, in
    the shared tier's lookups and on every machine its record reaches, while a
    restore by name never consults the floor.  The mark is its metadata, not
    that floor: a quantized snapshot of ``quantized_kv_start`` tokens has a
    floor above its length too (``servable.kv_bits_floor``) and is verified."""
    for old in writes.session_rows(db, namespace, name):
        if old.name is not None and marked(old.metadata):
            old_toks = unpack_tokens(old.tokens)
            if toks[: len(old_toks)] == old_toks:
                return True
    return False


def marked(metadata: bytes) -> bool:
    """Whether a row's metadata marks it unverified."""
    try:
        meta = msgpack.unpackb(metadata, raw=False)
    except Exception:  # an undecodable row (bit rot): check --fix's to repair
        return False
    return isinstance(meta, dict) and meta.get(UNVERIFIED_KEY) == "true"


class _Target(Protocol):
    """What ``inherit_mark`` reads of ``saving.Target`` (which imports this module)."""

    @property
    def unverified(self) -> bool: ...
    @property
    def name(self) -> str | None: ...
    @property
    def owner(self) -> str | None: ...


T = TypeVar("T", bound=_Target)


def inherit_mark(cache: Any, target: T) -> T:
    """``target``, unverified if ``cache`` continues a restored unverified session
    (``persist.marks``: ``Store.restore`` marks what it hands out) whatever name
    it is saved under; a save no session owns is refused, as an explicit one is."""
    from ..codecs.snapshot import Snapshot

    marked = cache.unverified if isinstance(cache, Snapshot) else carries_unverified(cache)
    if not marked or target.unverified:
        return target
    if target.name is None and target.owner is None:
        raise InvalidArgumentError(
            "this cache continues a session of unverified tokens: save it under a session name"
        )
    return cast(T, dataclasses.replace(cast(Any, target), unverified=True))
