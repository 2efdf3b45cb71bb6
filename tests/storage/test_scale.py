"""A store of thousands of chats that share a system prompt: every returning
conversation is found, and saves, lookups, listings and eviction do the same
SQL work at 3,000 sessions as at 300 (counted in SQLite VM steps, never timed).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

import persist
from persist.cli import cli
from persist.storage import listing
from tests.golden.cases import IDENTITY
from tests.golden.cases import kv_cache as kv
from tests.helpers import raw
from tests.store_helpers import steps

SYSTEM = list(range(1000, 1300))  # 300 tokens: one full block and 44 of the next
SMALL, BIG = 300, 3000


def own(i: int) -> list[int]:
    """40 tokens of chat i; chats 2k and 2k+1 share their first 20 (near neighbours)."""
    r = random.Random(i // 2)
    head = [r.randrange(2000, 60000) for _ in range(20)]
    return head + [random.Random(10**6 + i).randrange(2000, 60000) for _ in range(20)]


def chat(i: int) -> list[int]:
    return SYSTEM + own(i)


BASE = [kv(340, 1), kv(340, 3)]  # every chat's cache (the same bytes: no blob writes)


def grow(store: persist.Store, start: int, stop: int) -> None:
    for i in range(start, stop):  # one in ten with bytes of its own: live blobs grow too
        cache = [kv(340, 10 + i), kv(340, 11 + i)] if i % 10 == 0 else BASE
        store.save(cache, chat(i), identity=IDENTITY, session=f"chat{i}")


def work(store: persist.Store, n: int) -> dict[str, int]:
    """VM steps of each operation in a store of ``n`` chats (each leaves it at ``n``)."""
    ids = iter(range(10**6 + n * 10, 10**7))
    longer = [kv(380, 5), kv(380, 6)]
    out = {
        "new chat save": steps(store, lambda: grow(store, n, n + 1)),
        "returning save": steps(
            store,
            lambda: store.save(
                longer, chat(n) + own(next(ids)), identity=IDENTITY, session=f"chat{n}"
            ),
        ),
        "anonymous save": steps(
            store, lambda: store.save(BASE, SYSTEM + own(next(ids)), identity=IDENTITY)
        ),
        "lookup, returning": steps(store, lambda: find(store, chat(n // 2) + [7, 8])),
        "lookup, new chat": steps(store, lambda: find(store, SYSTEM + own(next(ids)))),
        "ls --limit 5": steps(store, lambda: list(listing.stream(store.index, limit=5))),
        "ls --sort used": steps(store, lambda: next(listing.stream(store.index, sort="used"))),
        "ls --prefix, first row": steps(  # every chat matches: pages, not the range at once
            store, lambda: next(listing.stream(store.index, prefix="chat", every=True))
        ),
    }
    store.delete(f"chat{n}")
    for i in range(n // 10):  # the oldest tenth pinned: eviction must not walk past them
        store.pin(f"chat{i}")
    report: list[Any] = []
    total = steps(store, lambda: report.append(store.gc(0, dry_run=True)))
    assert len(report[0].evicted) > n // 2  # every unpinned chat (they share their blobs)
    out["eviction, per victim"] = total // len(report[0].evicted)
    return out


def find(store: persist.Store, prompt: list[int]) -> tuple[Any, int]:
    found = store.find(prompt, identity=IDENTITY)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[persist.Store, Any]]:
    root = tmp_path_factory.mktemp("scale") / "s"
    with persist.Store(root) as s:
        s.index.db.execute("PRAGMA synchronous=OFF")  # build speed only: work is counted
        grow(s, 0, SMALL)
        small = work(s, SMALL)
        grow(s, SMALL, BIG)
        yield s, small


def test_every_returning_chat_resumes_from_its_own_session(store: Any) -> None:
    s, _ = store
    for i in [0, 1, 2, 3, 1234, 2998, 2999]:  # 3,000 share the system prompt
        entry, hit = find(s, chat(i) + [5, 6, 7])
        assert (entry.session, hit) == (f"chat{i}", 340), i
        cut = chat(i)[:330] + [9]  # diverges inside its own tail: still its own state
        assert find(s, cut)[1] == 330 and find(s, cut)[0].session == f"chat{i}", i
    got = s.lookup(chat(5) + [1], identity=IDENTITY)
    assert got is not None and got.entry.session == "chat5" and len(got.tokens) == 340
    for layer, want in zip(got.cache, BASE, strict=True):  # the cache handed out is the saved one
        assert raw(layer.keys[..., :340, :]) == raw(want.keys[..., :340, :])


def test_a_new_chat_gets_the_longest_prefix_any_session_shares(store: Any) -> None:
    s, _ = store
    for seed in range(5):
        sibling = own(2 * (700 + seed))[:20]  # shares 20 tokens with chats 1400+2s, 1401+2s
        prompt = SYSTEM + sibling + [1, 2, 3]
        entry, hit = find(s, prompt)
        assert hit == 320 and entry.session in {f"chat{1400 + 2 * seed}", f"chat{1401 + 2 * seed}"}
    entry, hit = find(s, [*SYSTEM, 1, 2, 3])
    assert hit == 300


def test_sql_work_does_not_grow_with_the_store(store: Any) -> None:
    s, small = store
    big = work(s, BIG)
    for what, n in small.items():  # a seek is one VM step at any depth: a scan shows
        assert big[what] <= 1.1 * n + 50, (what, n, big[what])


def test_ls_streams_pages_and_keeps_its_orders(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    s, _ = store
    read = [0]
    real = listing.row_of
    monkeypatch.setattr(listing, "row_of", lambda r: read.__setitem__(0, read[0] + 1) or real(r))
    rows = listing.stream(s.index, sort="used")
    next(rows)
    assert read[0] <= listing.PAGE < BIG  # the first row came before the rest were read
    monkeypatch.undo()
    every = s.sessions()
    names = [e.session for e in every]
    assert [r.name for r in listing.stream(s.index)] == names
    by_used = sorted(every, key=lambda e: (e.used, e.id), reverse=True)
    assert [r.id for r in listing.stream(s.index, sort="used")] == [e.id for e in by_used]
    assert [r.id for r in listing.stream(s.index, sort="size", limit=3)] == [
        e.id for e in sorted(every, key=lambda e: (e.bytes, e.id), reverse=True)[:3]
    ]
    assert [r.name for r in listing.stream(s.index, prefix="chat12")] == [
        n for n in names if n.startswith("chat12")
    ]
    res = CliRunner().invoke(cli, ["ls", "--limit", "4", "--sort", "name", "--store", str(s.root)])
    lines = res.output.splitlines()
    assert res.exit_code == 0 and [x.split()[1] for x in lines[:4]] == names[:4], res.output
    assert not lines[4:] or lines[4].startswith("also "), res.output  # what --all would add


def test_ls_with_a_prefix_reads_only_the_rows_it_lists(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By name a prefix is a range it pages through; by use or size its matches are
    ordered from a covering index, and only the rows shown are read."""
    s, _ = store
    read = [0]
    real = listing.row_of
    monkeypatch.setattr(listing, "row_of", lambda r: read.__setitem__(0, read[0] + 1) or real(r))
    for sort in listing.SORTS:
        read[0] = 0
        got = list(listing.stream(s.index, sort=sort, prefix="chat", every=True, limit=5))
        assert len(got) == 5 and read[0] <= listing.PAGE < BIG, (sort, read[0])
    monkeypatch.undo()
    every = [e for e in s.entries() if (e.session or e.owner or "").startswith("chat1")]
    for sort, key in (("used", lambda e: (e.used, e.id)), ("size", lambda e: (e.bytes, e.id))):
        want = [e.id for e in sorted(every, key=key, reverse=True)]
        got_ids = [r.id for r in listing.stream(s.index, sort=sort, prefix="chat1", every=True)]
        assert got_ids == want, sort


def test_stats_reads_no_snapshot_row(store: Any) -> None:
    """Store.stats() counts entries, sessions and bytes from a covering index: every
    statement it runs on ``snapshots`` is planned without reading the table."""
    s, _ = store
    sql: list[str] = []
    s.index.db.conn.set_trace_callback(sql.append)
    try:
        stats = s.stats()
        one = s.stats("default")
    finally:
        s.index.db.conn.set_trace_callback(None)
    every = s.entries()
    named = sum(e.session is not None for e in every)
    assert (stats.entries, stats.sessions) == (len(every), named)
    assert stats.referenced_bytes == sum(e.bytes for e in every) == one.referenced_bytes
    reads = [q for q in sql if "snapshots" in q and q.lstrip().upper().startswith("SELECT")]
    assert reads
    for q in reads:
        plan = " | ".join(str(r[3]) for r in s.index.db.execute("EXPLAIN QUERY PLAN " + q))
        assert "COVERING INDEX" in plan, (q, plan)
