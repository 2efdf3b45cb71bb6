"""Unverified tokens: a session whose tokens are the caller's word (an imported
purely recurrent cache records no offset), and everything continued from it."""

from __future__ import annotations

from typing import Any

from ..format.tokens import unpack_tokens
from ..store import writes

__all__ = ["UNVERIFIED_KEY", "inherits_unverified"]

UNVERIFIED_KEY = "persist.unverified_tokens"  # session metadata: the session is unverified


def inherits_unverified(db: Any, namespace: str, name: str, toks: list[int]) -> bool:
    """A session continued from unverified tokens stays unverified, and so does a
    checkpoint it owns: their tokens still begin with what nothing checked.

    Unverified is a floor above the snapshot's length (``min_resume`` =
    n_tokens + 1): the resume policy then lets no lookup take any prefix of it,
    here, in the shared tier's lookups and on every machine its record reaches,
    while a restore by name never consults the floor."""
    for old in writes.session_rows(db, namespace, name):
        if old.name is not None and old.min_resume > old.n_tokens:
            old_toks = unpack_tokens(old.tokens)
            if toks[: len(old_toks)] == old_toks:
                return True
    return False
