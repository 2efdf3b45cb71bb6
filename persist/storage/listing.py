"""Listing a store: entries streamed in pages, in the order of an index.  No mlx.

``persist ls`` on a store of 100,000 sessions prints its first rows after
one page of one index walk, whatever the order asked for: by name
(``snapshots_name``, then checkpoints and prefixes by ``snapshots_unnamed``),
by last use or by size (``snapshots_used``, ``snapshots_bytes``), each page a
short read transaction that resumes after the last row of the one before.
A name prefix is a range of the name index per namespace, paged the same way;
ordered by use or size it is ordered from ``snapshots_tally`` (index entries
of the matches, then only the rows listed are read).  Rows come without their
token lists (a listing never needs them).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgumentError
from .rows import SNAPSHOT_COLS, SnapshotRow, check_name, check_namespace, row_of

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
    namespace = check_namespace(namespace)
    if prefix:
        check_name(prefix, "a session name's prefix")
    page = PAGE if limit is None else max(1, min(PAGE, limit))  # --limit 5 reads 5 rows
    if prefix is not None:
        rows = _prefixed(
            index, namespace, every=every, sort=sort, prefix=prefix, page=page, limit=limit
        )
    elif sort == "name":
        rows = _by_name(index, namespace, every, page)
    else:
        rows = _ordered(index, namespace, every, sort, page)
    return rows if limit is None else itertools.islice(rows, limit)


def _pages(
    index: Index,
    select: str,
    *,
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
    after: tuple[str, ...] = ("namespace", "name")
    yield from _pages(
        index, select, filt=filt, args=args, order="namespace, name", after=after, page_rows=page
    )
    if every:
        filt, args = _filters(namespace, False)
        select = f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_unnamed"
        after = ("namespace", "role", "id")
        yield from _pages(
            index,
            select,
            filt=filt,
            args=args,
            order="namespace, role, id",
            after=after,
            page_rows=page,
        )


def _ordered(
    index: Index, namespace: str | None, every: bool, sort: str, page: int
) -> Iterator[SnapshotRow]:
    name, order, after = ORDERS[sort]
    filt, args = _filters(namespace, None if every else True)
    select = f"SELECT {COLS} FROM snapshots INDEXED BY {name}"
    yield from _pages(index, select, filt=filt, args=args, order=order, after=after, page_rows=page)


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
    index: Index,
    namespace: str | None,
    *,
    every: bool,
    sort: str,
    prefix: str,
    page: int,
    limit: int | None,
) -> Iterator[SnapshotRow]:
    """Sessions whose name starts with ``prefix`` (and their checkpoints): a range of the
    name (and owner) index per namespace, paged, so the first rows come after one page
    whatever the range holds.  By use or size the range's keys are ordered from the
    covering index ``snapshots_tally`` (work in index entries of the matches, no row
    read), then only the rows listed are read, a page at a time."""
    stop = _past(prefix)
    with index.read() as db:
        if namespace is not None:
            spaces = [namespace]
        else:
            spaces = [r[0] for r in db.execute("SELECT name FROM namespaces ORDER BY name")]
    if sort == "name":
        for ns in spaces:
            yield from _name_range(index, ns, "name", prefix=prefix, stop=stop, page=page)
            if every:
                yield from _name_range(index, ns, "owner", prefix=prefix, stop=stop, page=page)
        return
    key = "used" if sort == "used" else "bytes"
    ordered = heapq.merge(
        *(
            _range_keys(index, ns, every=every, key=key, prefix=prefix, stop=stop, limit=limit)
            for ns in spaces
        ),
        reverse=True,
    )
    while True:
        ids = [i for _, i in itertools.islice(ordered, page)]
        if not ids:
            return
        with index.read() as db:
            sql = f"SELECT {COLS} FROM snapshots WHERE id IN ({', '.join('?' * len(ids))})"
            got = {r.id: r for r in map(row_of, db.execute(sql, ids))}
        yield from (got[i] for i in ids if i in got)  # one deleted since: left out


def _name_range(
    index: Index, ns: str, col: str, *, prefix: str, stop: str | None, page: int
) -> Iterator[SnapshotRow]:
    """The sessions (``col`` name) or the checkpoints (``col`` owner) of namespace ``ns``
    whose name or owner starts with the prefix, in name (owner, id) order, paged."""
    bound = "" if stop is None else f" AND {col} < ?"
    args: list[Any] = [ns, prefix] if stop is None else [ns, prefix, stop]
    if col == "name":
        select = f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_name"
        filt = f" AND namespace = ? AND name IS NOT NULL AND name >= ?{bound}"
        yield from _pages(
            index, select, filt=filt, args=args, order="name", after=("name",), page_rows=page
        )
    else:
        select = f"SELECT {COLS} FROM snapshots INDEXED BY snapshots_owner"
        filt = f" AND namespace = ? AND owner >= ?{bound} AND name IS NULL"
        after = ("owner", "id")
        yield from _pages(
            index, select, filt=filt, args=args, order="owner, id", after=after, page_rows=page
        )


def _range_keys(
    index: Index,
    ns: str,
    *,
    every: bool,
    key: str,
    prefix: str,
    stop: str | None,
    limit: int | None,
) -> list[tuple[Any, int]]:
    """(``key``, id) of the matches in namespace ``ns``, largest first, from the covering
    index alone (SQLite keeps only the top ``limit`` when there is one)."""
    parts, args = [], list[Any]()
    for col, named in (("name", True), ("owner", False))[: 2 if every else 1]:
        where = f"namespace = ? AND name IS {'NOT ' if named else ''}NULL AND {col} >= ?"
        where += "" if stop is None else f" AND {col} < ?"
        parts.append(f"SELECT {key}, id FROM snapshots INDEXED BY snapshots_tally WHERE {where}")
        args += [ns, prefix] if stop is None else [ns, prefix, stop]
    sql = " UNION ALL ".join(parts) + " ORDER BY 1 DESC, 2 DESC"
    if limit is not None:
        sql, args = sql + " LIMIT ?", [*args, limit]
    with index.read() as db:
        return [(r[0], int(r[1])) for r in db.execute(sql, args)]


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
