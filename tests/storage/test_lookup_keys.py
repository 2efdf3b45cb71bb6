"""The index lookup is the resume policy over every stored row: random stores
(real SQLite, no mlx) where a brute-force ``policy.best_candidate`` over all rows and
``lookup.best_row`` over the lookup keys must pick the same row and prefix.
"""

from __future__ import annotations

import atexit
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from persist import policy
from persist.format.tokens import common_prefix_packed, pack_tokens
from persist.storage import keys, lookup, writes
from persist.storage.chains import HEAD_TOKENS, chains, head_key
from persist.storage.index import Index
from persist.storage.rows import BlockRef, NewBlob
from persist.storage.schema import connect

BLOCK = 4
ROOT = b"r" * 16
tok = st.integers(0, 2)  # a small alphabet: long shared prefixes, many branch points
snap = st.tuples(st.integers(0, 40), st.lists(tok, max_size=8), st.booleans(), st.integers(0, 30))


_EMPTY: list[Path] = []


def empty_index(tmp: Path) -> Index:
    """A new index, copied from one made once: every example's schema work (migrations,
    the WAL switch, their fsyncs) was most of this test's time; only the rows differ."""
    if not _EMPTY:
        first = Path(tempfile.mkdtemp(prefix="persist-lookup-keys-")) / "index.sqlite"
        atexit.register(shutil.rmtree, first.parent, True)
        connect(first, BLOCK).conn.close()  # the last close checkpoints: one file
        _EMPTY.append(first)
    shutil.copyfile(_EMPTY[0], tmp / "index.sqlite")
    index = Index(connect(tmp / "index.sqlite", BLOCK))
    index.db.execute("PRAGMA synchronous=OFF")  # speed only: the same rows and queries
    return index


def store(tmp: Path, base: list[int], snaps: list[tuple[int, list[int], bool, int]]) -> Index:
    index = empty_index(tmp)
    with index.write() as db:
        for i, (cut, extra, trimmable, floor) in enumerate(snaps):
            toks = base[:cut] + extra
            chs = chains(ROOT, toks, BLOCK)
            n = len(toks) // BLOCK
            tail = NewBlob(f"{i:032x}.t", f"{i:032x}", 1, bytes(16))
            writes.add_blobs(db, "ns", [tail])
            row = {
                "namespace": "ns",
                "name": f"s{i}",
                "owner": f"s{i}",
                "role": "session",
                "identity": "id",
                "identity_map": msgpack.packb({}),
                "root": ROOT,
                "last_chain": chs[n] if n else head_key(ROOT, toks),
                "n_blocks": n,
                "n_tokens": len(toks),
                "tokens": pack_tokens(toks),
                "trimmable": int(trimmable),
                "min_resume": min(floor, len(toks)),
                "manifest": msgpack.packb({"block": BLOCK}),
                "tail": tail.file,
                "bytes": 1,
                "pinned": 0,
                "created": 0.0,
                "used": time.time() + i,  # distinct: ties break the same way everywhere
                "metadata": msgpack.packb({}),
            }
            refs = [BlockRef(b, chs[b + 1], None) for b in range(n)]
            sid = writes.insert(db, row, refs)
            writes.add_heads(db, sid, chs, toks, BLOCK)
    return index


def brute(index: Index, prompt: list[int]) -> tuple[int, int] | None:
    packed = pack_tokens(prompt)
    with index.read() as db:
        rows = Index.rows_where(db, "1=1", [])
    cands = [
        (
            policy.Candidate(r.id, r.n_tokens, r.trimmable, r.min_resume, r.used),
            common_prefix_packed(r.tokens, packed),
        )
        for r in rows
    ]
    got = policy.best_candidate(cands, len(prompt))
    if got is None or got.prefix < HEAD_TOKENS:
        return None
    return got.candidate.id, got.prefix


@settings(max_examples=150, deadline=None)
@given(
    st.lists(tok, min_size=40, max_size=40),
    st.lists(snap, min_size=1, max_size=12),
    st.integers(0, 40),
    st.lists(tok, max_size=8),
)
def test_lookup_keys_pick_what_the_policy_picks_over_every_row(
    base: list[int], snaps: list[tuple[int, list[int], bool, int]], cut: int, extra: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as d:
        index = store(Path(d), base, snaps)
        prompt = base[:cut] + extra
        if not prompt:
            return
        chs = chains(ROOT, prompt, BLOCK)
        got = lookup.best_row(index, "ns", "id", chains=chs, toks=prompt, block=BLOCK, skip=set())
        assert (None if got is None else (got[0].id, got[1])) == brute(index, prompt)
        for sid in {r.id for r in index.snapshots("ns", False)}:  # removal leaves no key
            with index.write() as db:
                writes.remove(db, sid)
        with index.read() as db:
            left = [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in keys.TABLES]
        assert left == [0, 0]
        index.db.conn.close()


@given(st.lists(st.lists(tok, max_size=6), max_size=20), st.lists(tok, max_size=8))
def test_walks_agree_with_sorting(entries: list[list[int]], q: list[int]) -> None:
    """``levels`` yields every entry once, in order of tokens shared with q, and
    ``prefixes`` exactly the entries that are a prefix of q, longest first."""
    db = sqlite3.connect(":memory:")
    db.execute(
        "CREATE TABLE tails (anchor BLOB, trimmable INTEGER, rest BLOB, snapshot INTEGER, "
        "min_resume INTEGER, PRIMARY KEY (anchor, trimmable, rest, snapshot)) WITHOUT ROWID"
    )
    db.execute(
        "CREATE TABLE block_keys (anchor BLOB, rest BLOB, users INTEGER, "
        "PRIMARY KEY (anchor, rest)) WITHOUT ROWID"
    )
    for i, e in enumerate(entries):
        db.execute("INSERT INTO tails VALUES (?, 1, ?, ?, 0)", [b"a", keys.sort_pack(e), i])
    qp = keys.sort_pack(q)
    seen: list[tuple[int, int]] = []
    for depth, ranges in keys.levels(db, b"a", qp):  # type: ignore[arg-type]
        for lo, hi in ranges:
            sql = "SELECT snapshot, rest FROM tails WHERE rest >= ?" + (
                "" if hi is None else " AND rest < ?"
            )
            for sid, rest in db.execute(sql, [lo] + ([] if hi is None else [hi])):
                assert keys.shared_tokens(qp, rest) == depth
                seen.append((sid, depth))
    assert sorted(s for s, _ in seen) == list(range(len(entries)))
    assert [d for _, d in seen] == sorted((d for _, d in seen), reverse=True)
    want = sorted({tuple(e) for e in entries if q[: len(e)] == e}, key=len, reverse=True)
    got = [tuple(keys.unpack_sorted(r)) for r in keys.prefixes(db, b"a", qp, True)]  # type: ignore[arg-type]
    assert got == want
