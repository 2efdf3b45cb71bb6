"""Lookup keys: token lists sorted under the chain before them, and the walks over them.  No mlx.

Two tables (docs/FORMAT.md, section 5).  ``tails``: one row per snapshot,
its tokens after its last block boundary b under ``anchor`` = h_{b-1} (the
root at b = 0).  ``block_keys``: one row per distinct full block that some
trimmable snapshot holds, its tokens under the chain before it.  Tokens are
packed big-endian, so SQLite's byte order on BLOBs is the order of token
lists: the entries that share a prefix with a query are one range, and the
one that shares the most sits next to where the query would go, so two index
seeks find it however many entries share less (a radix search in a B-tree).
Hashes and these keys only select candidates; the stored token lists decide.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import msgpack

from ..format.tokens import common_prefix_packed, unpack_tokens
from .chains import chains as chain_hashes

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "sort_pack",
    "unpack_sorted",
    "shared_tokens",
    "past",
    "block_chain",
    "block_of",
    "add",
    "remove",
    "levels",
    "prefixes",
    "Range",
    "TABLES",
]

TABLES = ("tails", "block_keys")
Range = tuple[bytes, bytes | None]  # [lo, hi) over packed token lists; None: no end


def sort_pack(tokens: Sequence[int]) -> bytes:
    """Big-endian uint32: byte order is token-list order (a prefix sorts first)."""
    return struct.pack(f">{len(tokens)}I", *tokens)


def unpack_sorted(raw: bytes) -> list[int]:
    return list(struct.unpack(f">{len(raw) // 4}I", raw))


def shared_tokens(a: bytes, b: bytes) -> int:
    """Tokens two packed lists share from the start (any byte order: whole tokens compare)."""
    return common_prefix_packed(a, b)


def past(prefix: bytes) -> bytes | None:
    """The least list above every list that starts with ``prefix`` (None: nothing is)."""
    body = prefix.rstrip(b"\xff")
    return body[:-1] + bytes([body[-1] + 1]) if body else None


def block_chain(anchor: bytes, tokens: Sequence[int]) -> bytes:
    """The chain of one full block of ``tokens`` under ``anchor`` (``chains``' rule)."""
    return chain_hashes(anchor, tokens, len(tokens))[1]


def add(
    db: sqlite_utils.Database,
    snapshot_id: int,
    *,
    chains: Sequence[bytes],
    tokens: Sequence[int],
    block: int,
    trimmable: bool,
    min_resume: int,
) -> None:
    """The keys of a new snapshot (``chains`` as ``chains()`` gives them, h_-1 first)."""
    n = len(tokens) // block
    db.execute(
        "INSERT OR IGNORE INTO tails(anchor, trimmable, rest, snapshot, min_resume) "
        "VALUES (?, ?, ?, ?, ?)",
        [chains[n], int(trimmable), sort_pack(tokens[n * block :]), snapshot_id, min_resume],
    )
    if not trimmable:  # an untrimmable snapshot serves only at its own length: its tail
        return
    for i in range(n):
        db.execute(
            "INSERT INTO block_keys(anchor, rest, users) VALUES (?, ?, 1) "
            "ON CONFLICT(anchor, rest) DO UPDATE SET users = users + 1",
            [chains[i], sort_pack(tokens[i * block : (i + 1) * block])],
        )


def remove(db: sqlite_utils.Database, snapshot_id: int) -> None:
    """Drop a snapshot's keys (before its row and blocks go): O(its blocks)."""
    row = db.execute(
        "SELECT root, n_blocks, tokens, trimmable, manifest FROM snapshots WHERE id = ?",
        [snapshot_id],
    ).fetchone()
    if row is None:
        return
    root, toks, trimmable = _b(row[0]), unpack_tokens(_b(row[2])), row[3]
    n = row[1] if isinstance(row[1], int) else -1  # a wrongly typed column: damage
    block = block_of(_b(row[4]), _store_block(db))
    every = [root] + [
        _b(r[0])
        for r in db.execute(
            "SELECT chain FROM snapshot_blocks WHERE snapshot = ? ORDER BY idx", [snapshot_id]
        )
    ]
    gone = len(every) == n + 1 and (
        db.execute(
            "DELETE FROM tails WHERE anchor = ? AND trimmable = ? AND rest = ? AND snapshot = ?",
            [every[n], int(trimmable), sort_pack(toks[n * block :]), snapshot_id],
        ).rowcount
        > 0
    )
    if not gone:  # a damaged row (its keys cannot be rebuilt from it): find them (a scan)
        db.execute("DELETE FROM tails WHERE snapshot = ?", [snapshot_id])
        return
    if not trimmable:
        return
    for i in range(n):
        key = [every[i], sort_pack(toks[i * block : (i + 1) * block])]
        db.execute("UPDATE block_keys SET users = users - 1 WHERE anchor = ? AND rest = ?", key)
        db.execute("DELETE FROM block_keys WHERE anchor = ? AND rest = ? AND users <= 0", key)


def _b(v: object) -> bytes:
    """A BLOB column's value; another type (a damaged index) reads as empty."""
    return bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else b""


def block_of(manifest: bytes, default: int) -> int:
    """The block size a snapshot was cut with (its manifest says; else ``default``)."""
    try:
        return int(msgpack.unpackb(manifest, raw=False)["block"])
    except Exception:  # a damaged or bare manifest: the store's block size made the row
        return default


def _store_block(db: sqlite_utils.Database) -> int:
    return int(db.execute("SELECT value FROM meta WHERE key = 'block_tokens'").fetchone()[0])


# -- walks ----------------------------------------------------------------------


def _nearest(db: sqlite_utils.Database, sql: str, args: list[object]) -> bytes | None:
    row = db.execute(sql, args).fetchone()
    return None if row is None else bytes(row[0])


def levels(
    db: sqlite_utils.Database, anchor: bytes, q: bytes, seen_whole: bool = False
) -> Iterator[tuple[int, list[Range]]]:
    """Trimmable entries under ``anchor`` by how many tokens of ``q`` they share, most first.

    Yields (shared tokens, the ranges of ``rest`` that hold exactly the entries
    sharing that many), each level the nearest entries outside the ranges seen
    so far: O(log entries) per level, however many entries a level holds.
    ``seen_whole``: the entries that hold all of ``q`` count as seen.
    """
    lo, hi = (q, past(q)) if seen_whole else (q, q)  # the ranges seen so far: [lo, hi)
    sources = (("tails", "AND trimmable = 1 "), ("block_keys", ""))
    while True:
        near = []
        for table, only in sources:
            near.append(
                _nearest(
                    db,
                    f"SELECT rest FROM {table} WHERE anchor = ? {only}AND rest < ? "
                    "ORDER BY rest DESC LIMIT 1",
                    [anchor, lo],
                )
            )
            if hi is not None:
                near.append(
                    _nearest(
                        db,
                        f"SELECT rest FROM {table} WHERE anchor = ? {only}AND rest >= ? "
                        "ORDER BY rest LIMIT 1",
                        [anchor, hi],
                    )
                )
        found = [shared_tokens(q, r) for r in near if r is not None]
        if not found:
            return
        depth = max(found)
        start, stop = q[: 4 * depth], past(q[: 4 * depth])
        ranges: list[Range] = [(start, lo)] if start < lo else []
        if hi is not None and (stop is None or hi < stop):
            ranges.append((hi, stop))
        yield depth, ranges
        lo, hi = start, stop


def prefixes(
    db: sqlite_utils.Database, anchor: bytes, q: bytes, trimmable: bool
) -> Iterator[bytes]:
    """The ``rest`` values under ``anchor`` (tails of this trimmability) that are a
    prefix of ``q``, longest first: each step finds one or passes a branch point."""
    bound, strict = q, False
    while True:
        op = "<" if strict else "<="
        e = _nearest(
            db,
            f"SELECT rest FROM tails WHERE anchor = ? AND trimmable = ? AND rest {op} ? "
            "ORDER BY rest DESC LIMIT 1",
            [anchor, int(trimmable), bound],
        )
        if e is None:
            return
        depth = shared_tokens(q, e)
        if 4 * depth == len(e):  # all of e is a prefix of q
            yield e
            bound, strict = e, True
        else:  # prefixes of q below e are at most its shared part
            bound, strict = q[: 4 * depth], False
