"""The rows nearest a prompt, found through the lookup keys: what a bounded explain reads.  No mlx.

``Store.explain`` reads every row of a namespace: right for a person asking
once, too much for ``persist serve``, which explains every miss (its metrics
count misses by reason).  A bounded explain reads only the rows these probes
lead to, for the prompt's identity and for the few other identities the
namespace's most recently used rows were computed by (a model swapped, another
``--kv-bits``), each probe a handful of index seeks:

- the deepest block of the prompt that some row of that identity holds
  (``lookup.matched_blocks``, a binary search) and the rows holding it, most
  recent first: every row sharing the longest prefix holds that block;
- under that block, the lookup keys next to the prompt's next tokens in sort
  order (``keys``: the entry sharing the most sits next to where the prompt
  would go), in ``tails`` (any trimmability) and in ``block_keys``.

What it can miss: an untrimmable row that diverges inside a block more than
``NEAR_ROWS`` rows hold, and identities not among the ``RECENT_ROWS`` most
recently used rows.  Explain adds the lookup's own choice (``best_row``), so
what is missed is a near or longest row, never the best hit.  Hashes and
keys only select rows; their tokens decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import keys
from .chains import chain_root, chains
from .index import BLOCKS_THEN_SNAPSHOTS, Index
from .lookup import matched_blocks
from .rows import SnapshotRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["near_rows", "NEAR_ROWS", "RECENT_ROWS"]

NEAR_ROWS = 16  # rows read per probe
RECENT_ROWS = 64  # the most recently used rows (pinned, unpinned) whose identities are probed


def near_rows(
    index: Index, namespace: str, identity: str, toks: Sequence[int], block: int
) -> list[SnapshotRow]:
    """Rows of ``namespace`` near ``toks`` (for ``identity`` first, then the other
    identities of its recent rows); [] for a namespace that does not exist."""
    secret = index.secret(namespace)  # a probe never creates a namespace
    if secret is None or not toks:
        return []
    with index.read() as db:
        ids: list[int] = []
        for digest in [identity, *_recent_identities(db, namespace, identity)]:
            chs = chains(chain_root(secret, digest), toks, block)
            ids += _near_ids(db, namespace, digest, chs=chs, toks=list(toks), block=block)
        unique = list(dict.fromkeys(ids))
        marks = ",".join("?" * len(unique))
        return Index.rows_where(db, f"id IN ({marks})", unique) if unique else []


def _recent_identities(db: sqlite_utils.Database, namespace: str, identity: str) -> list[str]:
    """The other identities of the namespace's most recently used rows, pinned or not
    (each one seek along (namespace, pinned, used))."""
    found: dict[str, None] = {}
    for pinned in (0, 1):
        got = db.execute(
            "SELECT identity FROM snapshots INDEXED BY snapshots_ns_lru "
            "WHERE namespace = ? AND pinned = ? ORDER BY used DESC LIMIT ?",
            [namespace, pinned, RECENT_ROWS],
        )
        found.update((r[0], None) for r in got if r[0] != identity)
    return list(found)


def _near_ids(
    db: sqlite_utils.Database,
    namespace: str,
    digest: str,
    *,
    chs: list[bytes],
    toks: list[int],
    block: int,
) -> list[int]:
    """Ids of the rows of one identity that share the most with ``toks`` (chains ``chs``)."""
    m = matched_blocks(db, namespace, digest, chs)
    out = _holding(db, namespace, digest, chs[m], m - 1) if m else []
    anchor, q = chs[m], keys.sort_pack(toks[m * block : (m + 1) * block])
    for trimmable in (0, 1):  # the key's order is (anchor, trimmable, rest)
        for rest in _neighbours(db, "tails", anchor, q, f"AND trimmable = {trimmable} "):
            out += [
                r[0]
                for r in db.execute(
                    "SELECT t.snapshot FROM tails t CROSS JOIN snapshots s ON s.id = t.snapshot "
                    "WHERE t.anchor = ? AND t.trimmable = ? AND t.rest = ? AND s.namespace = ? "
                    "AND s.identity = ? LIMIT ?",
                    [anchor, trimmable, rest, namespace, digest, NEAR_ROWS],
                )
            ]
    for rest in _neighbours(db, "block_keys", anchor, q):
        chain = keys.block_chain(anchor, keys.unpack_sorted(rest))
        out += _holding(db, namespace, digest, chain, m)
    return out


def _holding(
    db: sqlite_utils.Database, namespace: str, digest: str, chain: bytes, idx: int
) -> list[int]:
    """The most recent rows (of this namespace and identity) holding block ``idx`` = ``chain``."""
    return [
        r[0]
        for r in db.execute(
            f"SELECT s.id FROM {BLOCKS_THEN_SNAPSHOTS} ON s.id = b.snapshot "
            "WHERE b.chain = ? AND b.idx = ? AND s.namespace = ? AND s.identity = ? "
            "ORDER BY b.rowid DESC LIMIT ?",
            [chain, idx, namespace, digest, NEAR_ROWS],
        )
    ]


def _neighbours(
    db: sqlite_utils.Database, table: str, anchor: bytes, q: bytes, only: str = ""
) -> list[bytes]:
    """The keys under ``anchor`` just below and at-or-above ``q``: the one sharing the most
    with ``q`` is one of them (two index seeks)."""
    out = []
    for op, order in (("<", "DESC"), (">=", "ASC")):
        row = db.execute(
            f"SELECT rest FROM {table} WHERE anchor = ? {only}AND rest {op} ? "
            f"ORDER BY rest {order} LIMIT 1",
            [anchor, q],
        ).fetchone()
        if row is not None:
            out.append(bytes(row[0]))
    return out
