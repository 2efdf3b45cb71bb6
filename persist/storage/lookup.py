"""The index queries of a lookup: which snapshots may serve a prompt.  No mlx.

One read transaction.  First how many of the prompt's blocks some snapshot
holds (a binary search of one-key queries); then, under the chain of those
m blocks, the lookup keys (``keys``) in order of how many more prompt tokens
they share: every snapshot sharing the longest prefix is in the first level,
however many share a shorter one, and a returning conversation meets its own
snapshot (a prefix of the prompt) at its full length.  Each level costs
O(log sessions) seeks plus a bounded number of candidates of the same usable
prefix; if none of them can serve, the next level, then the block before.
Only the candidates' rows (token lists included) are read; the caller's
policy compares tokens in full and applies the resume rules.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..format.tokens import common_prefix_packed, pack_tokens
from ..policy import COULD_SERVE_SQL, Candidate
from ..policy import best_candidate as choose_by_policy
from ..servable import of_row
from . import keys
from .chains import HEAD_TOKENS
from .index import BLOCKS_THEN_SNAPSHOTS, Index
from .rows import SnapshotRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["best_row", "matched_blocks", "candidate_rows", "LEVEL_CANDIDATES"]

# Rows read per level: all of a level's candidates reuse the same number of
# tokens, so these only break ties (an exact length first, then recency).
LEVEL_CANDIDATES = 16

Fetch = Callable[[int], list[int]]  # how many ids at most -> candidate ids


class _Query:
    """What every candidate query of one lookup shares: the prompt, the filters."""

    def __init__(
        self,
        db: Any,
        namespace: str,
        identity: str,
        toks: list[int],
        skip: set[int],
        quantized_start: int | None,
    ) -> None:
        self.db, self.toks, self.skip = db, toks, sorted(skip)
        self.quantized_start = quantized_start  # the rows' rules need it (servable.of_row)
        # policy.COULD_SERVE_SQL: rows that could serve from index columns alone
        self.filt = f" AND s.namespace = ? AND s.identity = ? AND {COULD_SERVE_SQL}"
        self.args: list[Any] = [namespace, identity, len(toks) - 1, len(toks) - 1]
        if self.skip:  # rows found damaged are passed over
            self.filt += f" AND s.id NOT IN ({','.join('?' * len(self.skip))})"
            self.args += self.skip

    def ids(self, sql: str, args: Sequence[Any], limit: int) -> list[int]:
        return [r[0] for r in self.db.execute(sql, [*args, *self.args, limit])]


def matched_blocks(
    db: sqlite_utils.Database, namespace: str, identity: str, chains: Sequence[bytes]
) -> int:
    """How many leading blocks of a prompt (block chains ``chains[1:]``) some snapshot holds.

    A snapshot holding block i holds every block before it, so the matched
    blocks are a prefix of the prompt's: a binary search of single-key
    queries, whatever the prompt's length.
    """
    lo, hi = 0, len(chains) - 1
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


def _range_sql(col: str, r: keys.Range) -> tuple[str, list[bytes]]:
    lo, hi = r
    return (f"{col} >= ?", [lo]) if hi is None else (f"{col} >= ? AND {col} < ?", [lo, hi])


def _trimmable(q: _Query, anchor: bytes, idx: int, at: int, ranges: list[keys.Range]) -> Fetch:
    """Trimmable snapshots whose tail or full block ``idx`` lies in ``ranges``: each
    shares exactly ``at`` tokens with the prompt, and may serve if its floor allows."""

    def fetch(limit: int) -> list[int]:
        out: list[int] = []
        for r in ranges:
            where, bounds = _range_sql("t.rest", r)
            out += q.ids(
                "SELECT t.snapshot FROM tails t CROSS JOIN snapshots s ON s.id = t.snapshot "
                f"WHERE t.anchor = ? AND t.trimmable = 1 AND {where} AND t.min_resume <= ?"
                f"{q.filt} LIMIT ?",
                [anchor, *bounds, at],
                limit - len(out),
            )
            where, bounds = _range_sql("rest", r)
            blocks = q.db.execute(
                f"SELECT rest FROM block_keys WHERE anchor = ? AND {where}", [anchor, *bounds]
            )
            for (rest,) in blocks:
                if len(out) >= limit:
                    return out
                chain = keys.block_chain(anchor, keys.unpack_sorted(bytes(rest)))
                out += q.ids(
                    f"SELECT s.id FROM {BLOCKS_THEN_SNAPSHOTS} ON s.id = b.snapshot "
                    "WHERE b.chain = ? AND b.idx = ? AND s.trimmable = 1 AND s.min_resume <= ?"
                    f"{q.filt} ORDER BY b.rowid DESC LIMIT ?",
                    [chain, idx, at],
                    limit - len(out),
                )
        return out

    return fetch


def _exact(q: _Query, anchor: bytes, rest: bytes, at: int) -> Fetch:
    """Untrimmable snapshots whose every token is a prefix of the prompt (``at`` long)."""
    return lambda limit: q.ids(
        "SELECT t.snapshot FROM tails t CROSS JOIN snapshots s ON s.id = t.snapshot "
        "WHERE t.anchor = ? AND t.trimmable = 0 AND t.rest = ? AND t.min_resume <= ?"
        f"{q.filt} LIMIT ?",
        [anchor, rest, at],
        limit,
    )


def _levels(
    q: _Query, anchor: bytes, k: int, block: int, whole: bool
) -> Iterator[tuple[int, Fetch]]:
    """(usable tokens, fetch) under boundary k, most tokens first: the trimmable levels
    and the untrimmable exact prefixes merged.  ``whole``: the prompt's own block k is
    held deeper and was tried there."""
    usable = len(q.toks) - 1
    qk = keys.sort_pack(q.toks[k * block : min(usable, (k + 1) * block)])
    base = k * block
    trim = (
        (base + d, _trimmable(q, anchor, k, base + d, ranges))
        for d, ranges in keys.levels(q.db, anchor, qk, seen_whole=whole)
    )
    exact = (
        (base + len(e) // 4, _exact(q, anchor, e, base + len(e) // 4))
        for e in keys.prefixes(q.db, anchor, qk, trimmable=False)
    )
    return heapq.merge(trim, exact, key=lambda lv: -lv[0])


def candidate_rows(db: sqlite_utils.Database, ids: Sequence[int]) -> list[SnapshotRow]:
    """Full rows (tokens included) of a bounded list of ids, in their order."""
    if not ids:
        return []
    marks = ",".join("?" * len(ids))
    got = {r.id: r for r in Index.rows_where(db, f"id IN ({marks})", list(ids))}
    return [got[i] for i in dict.fromkeys(ids) if i in got]


def _pick(q: _Query, ids: list[int], at: int, packed: bytes) -> tuple[SnapshotRow, int] | None:
    """The policy's choice among one level's candidates (each sharing ``at`` tokens by
    its keys), confirmed on the chosen row's tokens, compared in full; a row whose
    tokens disagree (damage, a collision) gives way to the next choice."""
    if not ids:
        return None
    db, toks = q.db, q.toks
    marks = ",".join("?" * len(ids))
    facts = db.execute(
        f"SELECT id, n_tokens, trimmable, min_resume, used FROM snapshots WHERE id IN ({marks})",
        ids,
    ).fetchall()
    cands = {r[0]: Candidate(r[0], r[1], bool(r[2]), r[3], r[4]) for r in facts}
    while cands:
        picked = choose_by_policy([(c, at) for c in cands.values()], len(toks))
        if picked is None:
            return None
        (row,) = candidate_rows(db, [picked.candidate.id])
        lcp = common_prefix_packed(row.tokens, packed)  # tokens decide
        # and its layers' rules, under the identity's kv_bits
        rule = of_row(row.trimmable, row.min_resume, row.manifest, q.quantized_start)
        if choose_by_policy([(picked.candidate, lcp)], len(toks)) == picked and rule.serves(
            picked.prefix, row.n_tokens
        ):
            return row, picked.prefix
        del cands[picked.candidate.id]
    return None


def best_row(
    index: Index,
    namespace: str,
    identity: str,
    *,
    chains: Sequence[bytes],
    toks: list[int],
    block: int,
    skip: set[int],
    quantized_start: int | None = None,
) -> tuple[SnapshotRow, int] | None:
    """The row and usable prefix that serve ``toks`` (chains ``chains``), or None.

    Levels come in order of the tokens they would reuse, so the first level
    with a row the policy accepts holds the best hit.  Rows in ``skip``
    (found damaged) are passed over.  Hits shorter than HEAD_TOKENS are not
    worth a lookup.  ``quantized_start``: the identity's quantized_kv_start
    under kv_bits, for the rows' rules (``servable.of_row``).
    """
    usable = len(toks) - 1
    if usable < HEAD_TOKENS:
        return None
    packed = pack_tokens(toks)
    with index.read() as db:
        q = _Query(db, namespace, identity, toks, skip, quantized_start)
        m = min(matched_blocks(db, namespace, identity, chains), usable // block)
        for k in range(m, -1, -1):
            merged = _levels(q, chains[k], k, block, whole=k < m)
            for at, group in itertools.groupby(merged, key=lambda lv: lv[0]):
                if at < HEAD_TOKENS:
                    return None
                ids: list[int] = []
                for _, fetch in group:
                    ids += fetch(LEVEL_CANDIDATES - len(ids)) if len(ids) < LEVEL_CANDIDATES else []
                found = _pick(q, ids, at, packed)
                if found is not None:
                    return found
    return None
