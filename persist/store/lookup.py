"""The index queries of a lookup: which snapshots may serve a prompt.  No mlx.

Three steps, each bounded whatever the number of sessions: how many of the
prompt's blocks some snapshot holds (a binary search of one-key queries),
the snapshots that share those blocks and the HEAD_TOKENS after them, and,
if none of those can serve, the ones that share only the blocks.  Candidates
are ranked from covering indexes; only the chosen few rows (token lists
included) are read.  The caller compares tokens in full and applies the
resume policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..format.tokens import common_prefix_packed, pack_tokens
from ..policy import COULD_SERVE_SQL, Candidate
from ..policy import choose as choose_by_policy
from .chains import HEAD_TOKENS, head_key
from .index import BLOCKS_THEN_SNAPSHOTS, MAX_VARIABLES, Index
from .rows import SnapshotRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "choose",
    "matched_blocks",
    "by_head",
    "by_blocks",
    "MAX_CANDIDATES",
    "FALLBACK_CANDIDATES",
]

# Bounds on one lookup's work, whatever the number of sessions sharing a prefix.
MAX_CANDIDATES = 64
FALLBACK_CANDIDATES = 16
SINGLE_CHAINS = 8


def _serve_filter(namespace: str, identity: str, prompt_len: int) -> tuple[str, list[Any]]:
    """Rows that could serve a prompt of ``prompt_len`` tokens, from index columns alone.

    ``policy.COULD_SERVE_SQL``: an untrimmable snapshot longer than the
    prompt can never serve, nor one whose floor leaves no token to compute.
    """
    return (
        f" AND s.namespace = ? AND s.identity = ? AND {COULD_SERVE_SQL}",
        [namespace, identity, prompt_len - 1, prompt_len - 1],
    )


def _rows_by_id(db: sqlite_utils.Database, ids: Sequence[int]) -> list[SnapshotRow]:
    """Full rows (tokens included) of at most a bounded list of ids, in their order."""
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    got = {r.id: r for r in Index.rows_where(db, f"id IN ({marks})", list(ids))}
    return [got[i] for i in dict.fromkeys(ids) if i in got]


def matched_blocks(index: Index, namespace: str, identity: str, chains: Sequence[bytes]) -> int:
    """How many leading blocks of a prompt (block chains ``chains[1:]``) some snapshot holds.

    A snapshot holding block i holds every block before it, so the matched
    blocks are a prefix of the prompt's: a binary search of single-key
    queries, whatever the prompt's length.
    """
    lo, hi = 0, len(chains) - 1
    with index.read() as db:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            row = db.execute(
                f"SELECT 1 FROM {BLOCKS_THEN_SNAPSHOTS} ON s.id = b.snapshot "
                "WHERE b.chain = ? AND b.idx = ? AND s.namespace = ? AND s.identity = ? "
                "LIMIT 1",
                [chains[mid], mid - 1, namespace, identity],
            ).fetchone()
            lo, hi = (mid, hi) if row else (lo, mid - 1)
    return lo


def by_head(
    index: Index, namespace: str, identity: str, head: bytes, prompt_len: int
) -> list[SnapshotRow]:
    """Snapshots that share a prompt's matched blocks and the HEAD_TOKENS after them.

    Most recently used first, at most MAX_CANDIDATES: lookups stay bounded
    however many sessions share a prompt's prefix.
    """
    filt, args = _serve_filter(namespace, identity, prompt_len)
    with index.read() as db:
        ids = db.execute(
            "SELECT s.id FROM heads h INDEXED BY heads_key "
            "CROSS JOIN snapshots s INDEXED BY snapshots_facts "
            f"ON s.id = h.snapshot WHERE h.key = ?{filt} ORDER BY s.used DESC LIMIT ?",
            [head, *args, MAX_CANDIDATES],
        ).fetchall()
        return _rows_by_id(db, [r[0] for r in ids])


def by_blocks(
    index: Index,
    namespace: str,
    identity: str,
    chains: Sequence[bytes],
    matched: int,
    prompt_len: int,
) -> list[SnapshotRow]:
    """Snapshots that end within the prompt's ``matched`` blocks or go on past them.

    The fallback when no snapshot shares HEAD_TOKENS past the matched
    blocks, so every candidate's common prefix lies within HEAD_TOKENS of
    the others': the longest first, at most FALLBACK_CANDIDATES of each sort.
    """
    if matched == 0:
        return []
    filt, args = _serve_filter(namespace, identity, prompt_len)
    ids: list[int] = []
    with index.read() as db:
        ends = list(chains[1 : matched + 1])
        # The deepest chains one by one (an index walk that stops at the
        # limit, no sort), then the rest in bounded IN lists.
        parts = [[c] for c in reversed(ends[-SINGLE_CHAINS:])]
        rest = ends[:-SINGLE_CHAINS]
        parts += [rest[max(0, i - MAX_VARIABLES) : i] for i in range(len(rest), 0, -MAX_VARIABLES)]
        for part in parts:
            if len(ids) >= FALLBACK_CANDIDATES:
                break
            marks = ",".join("?" * len(part))
            ids += [
                r[0]
                for r in db.execute(
                    # a covering index: candidates are ranked without reading their rows
                    f"SELECT s.id FROM snapshots s INDEXED BY snapshots_ends "
                    f"WHERE s.last_chain IN ({marks}){filt} "
                    "ORDER BY s.n_tokens DESC, s.used DESC LIMIT ?",
                    [*part, *args, FALLBACK_CANDIDATES],
                )
            ]
        ids += [
            r[0]
            for r in db.execute(
                # 'more': the snapshot has blocks past this one (no row is read to know)
                f"SELECT s.id FROM snapshot_blocks b INDEXED BY snapshot_blocks_more "
                "CROSS JOIN snapshots s INDEXED BY snapshots_facts "
                f"ON s.id = b.snapshot WHERE b.chain = ? AND b.idx = ? AND b.more = 1 "
                f"AND s.trimmable = 1{filt} LIMIT ?",
                [chains[matched], matched - 1, *args, FALLBACK_CANDIDATES],
            )
        ]
        return _rows_by_id(db, ids)


def choose(
    index: Index,
    namespace: str,
    identity: str,
    chains: Sequence[bytes],
    toks: list[int],
    block: int,
    skip: set[int],
) -> tuple[SnapshotRow, int] | None:
    """The row and usable prefix that serve ``toks`` (chains ``chains``), or None.

    First the snapshots that share the prompt's matched blocks and the
    HEAD_TOKENS after them (any of those beats every other); if none of them
    can serve, the ones that share only the matched blocks.  Rows in ``skip``
    (found damaged) are passed over.
    """
    matched = matched_blocks(index, namespace, identity, chains)
    tiers = []
    if len(toks) - matched * block >= HEAD_TOKENS:
        head = head_key(chains[matched], toks[matched * block :])
        tiers.append(lambda: by_head(index, namespace, identity, head, len(toks)))
    tiers.append(lambda: by_blocks(index, namespace, identity, chains, matched, len(toks)))
    packed = pack_tokens(toks)
    for tier in tiers:
        rows = {r.id: r for r in tier() if r.id not in skip}
        cands = [
            (
                Candidate(r.id, r.n_tokens, r.trimmable, r.min_resume, r.used),
                common_prefix_packed(r.tokens, packed),  # tokens decide, compared in full
            )
            for r in rows.values()
        ]
        picked = choose_by_policy(cands, len(toks))
        if picked is not None:
            return rows[picked.candidate.id], picked.prefix
    return None
