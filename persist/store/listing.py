"""Listing a store: entries streamed in pages, in the order of an index.  No mlx.

``persist ls`` on a store of 100,000 sessions prints its first rows after
one page of one index walk, whatever the order asked for: by name
(``snapshots_name``, then checkpoints and prefixes by ``snapshots_unnamed``),
by last use or by size (``snapshots_used``, ``snapshots_bytes``), each page a
short read transaction that resumes after the last row of the one before.
A name prefix is a range of the name index per namespace.  Rows come without
their token lists (a listing never needs them).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from .rows import SNAPSHOT_COLS, SnapshotRow, row_of

if TYPE_CHECKING:
    from .index import Index

__all__ = ["SORTS", "stream", "unnamed_counts"]

SORTS = ("name", "used", "size")
PAGE = 256  # rows per read transaction
COLS = SNAPSHOT_COLS.replace(" tokens,", " x'' AS tokens,")

# sort -> (index, order, the columns a page resumes after)
ORDERS = {
    "used": ("snapshots_used", "used DESC, id DESC", ("used", "id")),
    "size": ("snapshots_bytes", "bytes DESC, id DESC", ("bytes", "id")),
}
ATTR = {"bytes": "nbytes"}  # column -> SnapshotRow attribute, where they differ


def stream(
    index: Index,
    namespace: str | None = None,
    *,
    every: bool = False,
    sort: str = "name",
    prefix: str | None = None,
    limit: int | None = None,
) -> Iterator[SnapshotRow]:
    """Snapshots (named sessions; ``every``: also checkpoints and prefixes) in ``sort``
    order: ``name`` (namespace, then name), ``used`` or ``size`` (largest first).

    ``prefix`` keeps the sessions whose name starts with it (and, with
    ``every``, the checkpoints they own); ``limit`` stops after that many rows.
    """
    if sort not in SORTS:
        raise InvalidArgumentError(f"sort must be one of {', '.join(SORTS)}, not {sort!r}")
    if limit is not None and (type(limit) is not int or limit < 0):
        raise InvalidArgumentError(f"limit must be a count >= 0, got {limit!r}")
    page = PAGE if limit is None else max(1, min(PAGE, limit))  # --limit 5 reads 5 rows
    if prefix is not None:
        rows = _prefixed(index, namespace, every, sort, prefix)
    elif sort == "name":
        rows = _by_name(index, namespace, every, page)
    else:
        rows = _ordered(index, namespace, every, sort, page)
    return rows if limit is None else itertools.islice(rows, limit)


def _pages(
    index: Index,
    select: str,
    filt: str,
    args: list[Any],
    order: str,
    after: tuple[str, ...],
    page_rows: int,
) -> Iterator[SnapshotRow]:
    """Rows of ``select`` in ``order`` (the columns ``after``, all ascending or all
    descending), page by page: each page resumes after the last row of the one before
    (a seek in the index), so no page costs more than its rows."""
    cmp = "<" if order.endswith("DESC") else ">"
    resume = f" AND ({', '.join(after)}) {cmp} ({', '.join('?' * len(after))})"
    last: list[Any] = []
    while True:
        sql = f"{select} WHERE 1=1{filt}{resume if last else ''} ORDER BY {order} LIMIT ?"
        with index.read() as db:
            page = [row_of(r) for r in db.execute(sql, [*args, *last, page_rows])]
        yield from page
        if len(page) < page_rows:
            return
        last = [getattr(page[-1], ATTR.get(c, c)) for c in after]


def _filters(namespace: str | None, named: bool | None) -> tuple[str, list[Any]]:
    sql, args = "", list[Any]()
    if named is True:
        sql += " AND name IS NOT NULL"
    elif named is False:
        sql += " AND name IS NULL"
    if namespace is not None:
        sql, args = sql + " AND namespace = ?", [namespace]
    return sql, args


def _by_name(index: Index, namespace: str | None, every: bool, page: int) -> Iterator[SnapshotRow]:
    filt, args = _filters(namespace, True)
    select = f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_name"
    yield from _pages(index, select, filt, args, "namespace, name", ("namespace", "name"), page)
    if every:
        filt, args = _filters(namespace, False)
        select = f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_unnamed"
        after = ("namespace", "role", "id")
        yield from _pages(index, select, filt, args, "namespace, role, id", after, page)


def _ordered(
    index: Index, namespace: str | None, every: bool, sort: str, page: int
) -> Iterator[SnapshotRow]:
    name, order, after = ORDERS[sort]
    filt, args = _filters(namespace, None if every else True)
    select = f"SELECT {COLS} FROM snapshots INDEXED BY {name}"
    yield from _pages(index, select, filt, args, order, after, page)


def _past(prefix: str) -> str | None:
    """The least text above every text that starts with ``prefix`` (code point order,
    which is SQLite's byte order of UTF-8); None: there is none."""
    body = prefix.rstrip("\U0010ffff")
    if not body:
        return None
    nxt = ord(body[-1]) + 1
    if 0xD800 <= nxt <= 0xDFFF:  # surrogates are not text
        nxt = 0xE000
    return body[:-1] + chr(nxt)


def _prefixed(
    index: Index, namespace: str | None, every: bool, sort: str, prefix: str
) -> Iterator[SnapshotRow]:
    """Sessions whose name starts with ``prefix`` (and their checkpoints): a range of
    the name (and owner) index per namespace, so the work is the matches'."""
    stop = _past(prefix)
    bound = "" if stop is None else " AND {0} < ?"
    tail = [] if stop is None else [stop]
    with index.read() as db:
        if namespace is not None:
            spaces = [namespace]
        else:
            spaces = [r[0] for r in db.execute("SELECT name FROM namespaces ORDER BY name")]
    out: list[SnapshotRow] = []
    for ns in spaces:
        with index.read() as db:
            found = [
                row_of(r)
                for r in db.execute(
                    f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_name WHERE namespace = ? "
                    f"AND name IS NOT NULL AND name >= ?{bound.format('name')} ORDER BY name",
                    [ns, prefix, *tail],
                )
            ]
            if every:
                found += [
                    row_of(r)
                    for r in db.execute(
                        f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_owner "
                        f"WHERE namespace = ? AND owner >= ?{bound.format('owner')} "
                        "AND name IS NULL ORDER BY owner, id",
                        [ns, prefix, *tail],
                    )
                ]
        if sort == "name":
            yield from found
        else:
            out += found
    key = {"used": lambda r: (r.used, r.id), "size": lambda r: (r.nbytes, r.id)}.get(sort)
    if key is not None:
        yield from sorted(out, key=key, reverse=True)


def unnamed_counts(index: Index, namespace: str | None = None) -> dict[str, int]:
    """How many checkpoints and prefixes there are (role -> count), from an index alone."""
    filt, args = _filters(namespace, False)
    with index.read() as db:
        return dict(
            db.execute(
                "SELECT role, COUNT(*) FROM snapshots INDEXED BY snapshots_unnamed "
                f"WHERE 1=1{filt} GROUP BY role",
                args,
            ).fetchall()
        )
