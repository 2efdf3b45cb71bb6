"""The index alone (real SQLite, no mlx): commits, reference counts, retirement, ids."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest

import persist
from persist.errors import CorruptBlobError
from persist.format.tokens import pack_tokens
from persist.storage import retention, schema, writes
from persist.storage.blobs import FileBlobs
from persist.storage.index import MAX_VARIABLES, Index
from persist.storage.rows import BlockRef, NewBlob
from persist.storage.schema import connect


@pytest.fixture
def index(tmp_path: Path) -> Index:
    return Index(connect(tmp_path / "index.sqlite", 4))


def blob(i: int) -> NewBlob:
    return NewBlob(f"{i:032x}.{i:012x}", f"{i:032x}", 100 + i, bytes(16))


def row(name: str | None, tokens: list[int], tail: str, **kw: Any) -> dict[str, Any]:
    now = time.time()
    return {
        "namespace": "default",
        "name": name,
        "owner": name,
        "role": "session" if name else "prefix",
        "identity": "digest",
        "identity_map": msgpack.packb({}),
        "root": b"r" * 16,
        "last_chain": b"c" * 16,
        "n_blocks": 0,
        "n_tokens": len(tokens),
        "tokens": pack_tokens(tokens),
        "trimmable": 1,
        "min_resume": 0,
        "manifest": b"",
        "tail": tail,
        "bytes": 0,
        "pinned": 0,
        "created": now,
        "used": now,
        "metadata": msgpack.packb({}),
        **kw,
    }


def commit(index: Index, name: str | None, tail: NewBlob, blocks: Sequence[NewBlob] = ()) -> int:
    new = [b for b in [tail, *blocks] if index.blob_head(b.file) is None]
    with index.write() as db:
        writes.add_blobs(db, "default", new)
        refs = [BlockRef(i, bytes([i]) * 16, b.file) for i, b in enumerate(blocks)]
        return writes.insert(db, row(name, [1, 2, 3], tail.file, n_blocks=len(refs)), refs)


def test_shared_blobs_die_with_their_last_user(index: Index) -> None:
    shared, t1, t2 = blob(1), blob(2), blob(3)
    a = commit(index, "a", t1, [shared])
    b = commit(index, "b", t2, [shared])
    assert index.blocks(a)[0].blob == index.blocks(b)[0].blob == shared.file
    with index.write() as db:
        writes.remove(db, a)
    assert index.collect() == [t1.file]  # the shared block still has a user
    with index.write() as db:
        writes.remove(db, b)
    assert sorted(index.collect()) == sorted([t1.file, t2.file, shared.file])


def test_ids_are_never_reused(index: Index) -> None:
    first = commit(index, "a", blob(1))
    with index.write() as db:
        writes.remove(db, first)
    assert commit(index, "a", blob(2)) == first + 1


def test_a_verified_row_reads_back_and_a_damaged_one_is_refused(index: Index) -> None:
    sid = commit(index, "a", blob(1), [blob(2)])
    got = index.by_name("default", "a")
    assert got is not None and got.id == sid and index.verified_blocks(got)[0].blob == blob(2).file
    with index.write() as db:
        db.execute("UPDATE snapshots SET tokens = ? WHERE id = ?", [pack_tokens([9, 9, 9]), sid])
    damaged = index.by_name("default", "a")
    assert damaged is not None
    with pytest.raises(CorruptBlobError):
        index.verified_blocks(damaged)


def test_session_rows_demote_and_pin(index: Index) -> None:
    sid = commit(index, "a", blob(1))
    with index.write() as db:
        writes.demote(db, sid)
        assert [r.name for r in writes.session_rows(db, "default", "a")] == [None]
        assert not writes.set_pinned(db, "default", "a", True)  # no named row left
    commit(index, "a", blob(2))
    with index.write() as db:
        assert writes.set_pinned(db, "default", "a", True)
        assert all(r.pinned for r in writes.session_rows(db, "default", "a"))


def test_blob_sizes_beyond_one_query(index: Index) -> None:
    many = [blob(i) for i in range(MAX_VARIABLES + 7)]
    with index.write() as db:
        writes.add_blobs(db, "default", many)
        sizes = writes.blob_sizes(db, [b.file for b in many])
    assert sizes == {b.file: b.size for b in many}


def test_budgets_evict_least_recently_used_first(index: Index, tmp_path: Path) -> None:
    ids = [commit(index, n, blob(i)) for i, n in enumerate("abc", start=1)]
    index.touch(ids[0])  # a is now the most recently used
    with index.write() as db:
        removed, over = retention.evict_lru(db, index, [(index.unique_bytes(db) - 1, None)], None)
    assert [r.name for r in removed] == ["b"] and over is None
    assert retention.collect(index, FileBlobs(tmp_path)) == 1


def test_budgets_are_checked() -> None:
    with pytest.raises(ValueError):
        retention.Budgets(max_bytes=-1)
    b = retention.Budgets(10, {"t": 5})
    assert b.of("t") == 5 and b.of("u") is None and b.scope("t") == "t"
    assert b.limits("t") == [(10, None), (5, "t")]


@pytest.mark.parametrize("verb", ["BEGIN", "BEGIN IMMEDIATE"])
def test_a_ctrl_c_as_a_transaction_begins_leaves_the_index_usable(
    verb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (round 4, session 3): a Ctrl-C lands while BEGIN runs, so Python raises
    it as the call returns, before the block that rolls back: the connection stayed
    inside the transaction (every later read failed with an untyped "cannot start a
    transaction within a transaction") and, for a write, kept the store's write lock."""
    index = Index(connect(tmp_path / "index.sqlite", 4))
    real = index.db.execute
    fired: list[str] = []

    def execute(sql: str, *a: Any, **k: Any) -> Any:
        out = real(sql, *a, **k)
        if sql == verb and not fired:
            fired.append(sql)
            raise KeyboardInterrupt  # the signal, raised as the C call returns
        return out

    monkeypatch.setattr(index.db, "execute", execute)
    with pytest.raises(KeyboardInterrupt), index.read() if verb == "BEGIN" else index.write():
        pass
    assert fired == [verb] and not index.db.conn.in_transaction
    assert index.secret("default", make=lambda: b"k" * 32) == b"k" * 32  # writes and reads
    other = Index(connect(tmp_path / "index.sqlite", 4))  # the write lock is free
    with other.write() as db:
        db.execute("SELECT 1")


@pytest.mark.parametrize("fault", ["locked", "ctrl-c"])
def test_a_begin_that_fails_at_open_is_the_error_raised(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a store checks and migrates its index in a transaction.  A Ctrl-C as
    BEGIN IMMEDIATE returned left the connection in it, holding the write lock; a
    BEGIN that fails (a database locked past the busy timeout) must still be the
    error raised, not a ROLLBACK's "no transaction is active"."""
    db = connect(tmp_path / "index.sqlite", 4)
    real = db.execute

    def execute(sql: str, *a: Any, **k: Any) -> Any:
        if sql == "BEGIN IMMEDIATE" and fault == "locked":
            raise sqlite3.OperationalError("database is locked")
        out = real(sql, *a, **k)
        if sql == "BEGIN IMMEDIATE":
            raise KeyboardInterrupt  # the signal, raised as the C call returns
        return out

    monkeypatch.setattr(db, "execute", execute)
    raised = (sqlite3.OperationalError, KeyboardInterrupt)[fault == "ctrl-c"]
    with pytest.raises(raised):
        schema._check_block_tokens(db, 4, tmp_path / "index.sqlite", False)
    assert not db.conn.in_transaction
    with pytest.raises(raised):
        schema._migrate(db, tmp_path / "index.sqlite")
    assert not db.conn.in_transaction


class SigintBefore:
    """A real SIGINT to this process just before the index runs ``sql`` the n-th time:
    Python raises it there, as it does when a Ctrl-C lands between two statements."""

    def __init__(self, index: Index, monkeypatch: pytest.MonkeyPatch, *sqls: str) -> None:
        real, self.left = index.db.execute, list(sqls)

        def execute(sql: str, *a: Any, **k: Any) -> Any:
            if self.left and sql == self.left[0]:
                self.left.pop(0)
                os.kill(os.getpid(), signal.SIGINT)
            return real(sql, *a, **k)

        monkeypatch.setattr(index.db, "execute", execute)


def put_secret(db: Any, name: str) -> None:
    db.execute("INSERT INTO namespaces(name, secret) VALUES (?, ?)", [name, b"s" * 32])


@pytest.mark.usefixtures("python_ctrl_c")
@pytest.mark.parametrize(
    "case", ["write's commit", "read's commit", "write's commit, then its rollback"]
)
def test_a_ctrl_c_as_a_transaction_ends_never_leaves_it_open(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (round 4, session 3): a Ctrl-C just before a write's COMMIT or a read's
    closing COMMIT left the connection inside the transaction: the store's write
    lock stayed held (other processes timed out), the next call failed untyped, and
    a second Ctrl-C before the ROLLBACK let the next read COMMIT the half-done
    write.  No transaction outlives the call; an interrupted write is rolled back."""
    index = Index(connect(tmp_path / "index.sqlite", 4))
    if case == "read's commit":
        SigintBefore(index, monkeypatch, "COMMIT")
        with pytest.raises(KeyboardInterrupt), index.read() as db:
            db.execute("SELECT 1")
    else:
        sqls = ["COMMIT"] + (["ROLLBACK"] if "rollback" in case else [])
        spy = SigintBefore(index, monkeypatch, *sqls)
        with pytest.raises(KeyboardInterrupt), index.write() as db:
            put_secret(db, "half")
        assert spy.left == []
    monkeypatch.undo()
    assert not index.db.conn.in_transaction
    assert index.secret("half") is None  # the interrupted write is not there
    other = Index(connect(tmp_path / "index.sqlite", 4))  # no lock held
    with other.write() as db:
        put_secret(db, "other")
    assert index.secret("other") == b"s" * 32


def test_an_index_locked_past_the_wait_is_a_typed_error(tmp_path: Path) -> None:
    """Attack (round 4, session 3): a lock held past SQLite's busy timeout surfaced as
    a raw sqlite3.OperationalError, which the CLI reports as a bug in persist."""
    holder = Index(connect(tmp_path / "index.sqlite", 4))
    index = Index(connect(tmp_path / "index.sqlite", 4))
    index.db.execute("PRAGMA busy_timeout=50")  # not a minute: the lock outlasts it
    with holder.write() as db:
        put_secret(db, "held")
        with pytest.raises(persist.StoreBusyError, match="locked"), index.write() as other:
            put_secret(other, "late")
    assert not index.db.conn.in_transaction
    assert index.secret("held") == b"s" * 32 and index.secret("late") is None
