"""A full disk, on a real small filesystem: reads go on, deletes free space, refusals are typed.

Round 3 filled a store's disk with saves: ``restore`` and ``lookup`` then
raised a raw ``sqlite3.OperationalError`` (the write that records the
restore rate failed), ``persist rm`` and ``persist gc`` exited 3 (persist
could not free the space it had filled) and a save's failed commit was
untyped.  The test mounts a tmpfs of its own (skipped where mounting is not
allowed) and fills it to the last byte.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mc

import persist
from persist.storage import full
from persist.storage.schema import JOURNAL_LIMIT
from tests.golden.cases import IDENTITY, kvs
from tests.helpers import persist_cli
from tests.mounts import small_disk

DISK = "4m"
N = 2000  # tokens per session: 128 KiB of keys and values


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", DISK) as mnt:
        yield mnt


def cache_of(seed: int) -> tuple[list[mc.KVCache], tuple[mx.array, mx.array]]:
    c = mc.KVCache()
    k, v = kvs(seed, N)
    c.update_and_fetch(k, v)
    return [c], (k, v)


def fill(mnt: Path) -> None:
    """Take every byte left, as another program on the disk would."""
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    st = os.statvfs(mnt)
    assert st.f_bavail == 0


def test_a_full_disk_keeps_reads_working_and_lets_persist_free_space(disk: Path) -> None:
    root = disk / "store"
    kept: dict[str, tuple[mx.array, mx.array]] = {}
    with persist.Store(root) as s:
        for i in range(200):
            cache, arrays = cache_of(100 + i)
            try:
                s.save(cache, list(range(N)), identity=IDENTITY, session=f"s{i}")
            except persist.StoreFullError:
                break  # typed, whatever part of the save met the full disk
            kept[f"s{i}"] = arrays
        else:
            pytest.fail("the disk never filled")
    assert len(kept) >= 3
    fill(disk)
    with persist.Store(root) as s:
        # reads: bit-exact, though no statistic can be written
        for name, (k, v) in list(kept.items())[:3]:
            r = s.restore(name, identity=IDENTITY)
            c = r.cache[0]
            got_k, got_v = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            assert mx.array_equal(got_k, k) and mx.array_equal(got_v, v)
        hit = s.lookup(list(range(N)) + [7], identity=IDENTITY)
        assert hit is not None and len(hit.tokens) == N
        with pytest.raises(persist.StoreFullError):
            s.save(cache_of(9999)[0], list(range(N)), identity=IDENTITY, session="more")
    assert full.dropped() > 0
    # deletes work on the full disk, from fresh processes (each needs SQLite's -shm)
    out = persist_cli(root, "ls", check=False)
    assert out.returncode == 0, out
    out = persist_cli(root, "rm", "s0", check=False)
    assert out.returncode == 0, out
    (disk / "filler").unlink()  # the space is someone else's to give back
    fill(disk)
    out = persist_cli(root, "gc", "--max-bytes", "300K", check=False)
    assert out.returncode == 0, out
    with persist.Store(root) as s:
        assert not s.has_session("s0")
        # what gc freed is room for a new save
        s.save(cache_of(4242)[0], list(range(N)), identity=IDENTITY, session="after")
        assert s.check() == []


def test_a_failed_commit_on_a_full_disk_is_typed(disk: Path) -> None:
    root = disk / "store"
    with persist.Store(root) as s:
        s.save(cache_of(1)[0], list(range(N)), identity=IDENTITY, session="a")
    with persist.Store(root) as s:  # open before the disk fills: SQLite's -shm exists
        (root / full.RESERVE).unlink()  # no reserve: every refusal still typed
        fill(disk)
        with pytest.raises(persist.StoreFullError):
            s.save(cache_of(2)[0], list(range(N)), identity=IDENTITY, session="b")
        r = s.restore("a", identity=IDENTITY)
        assert r.tokens == list(range(N))
        try:
            s.delete("a")
        except persist.PersistError as e:
            assert isinstance(e, persist.StoreFullError), e
        else:
            assert not s.has_session("a")


def test_full_disk_errors_are_told_apart_from_damage() -> None:
    import sqlite3

    assert full.full_disk(sqlite3.OperationalError("database or disk is full"))
    assert full.full_disk(OSError(errno.ENOSPC, "No space left on device"))
    assert not full.full_disk(sqlite3.OperationalError("database is locked"))
    assert not full.full_disk(OSError(errno.EACCES, "Permission denied"))


def test_gc_on_a_full_disk_frees_it_without_a_raw_error(disk: Path) -> None:
    """Round 5: ``persist gc`` on a full disk evicted every session, then failed on a
    raw "database or disk is full" (exit 3) compacting the index: the disk stayed
    full (the log, the re-made reserve), later saves were refused, a second gc did
    not help.  Now the log is truncated first, VACUUM runs only with room for it, and
    the reserve is made again only once there is room."""
    root = disk / "store"
    with persist.Store(root) as s:  # small sessions: the index is large beside the blobs
        for i in range(5000):
            c = mc.KVCache()
            c.update_and_fetch(*kvs(300 + i, 16))
            try:
                s.save([c], [i % 7, *range(15)], identity=IDENTITY, session=f"s{i}")
            except persist.StoreFullError:
                break
        else:
            pytest.fail("the disk never filled")
    fill(disk)
    for _ in range(2):  # a second gc on the emptied store is as quiet
        out = persist_cli(root, "gc", "--max-bytes", "0", check=False)
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr and "bug in persist" not in out.stderr
    st = os.statvfs(disk)
    assert st.f_bavail * st.f_frsize > 1 << 20  # the blobs' space came back
    wal = root / "index.sqlite-wal"
    assert not wal.exists()  # not left full: gc's last close checkpointed and removed it
    with persist.Store(root) as s:
        assert s.sessions() == []
        s.save(cache_of(7)[0], list(range(N)), identity=IDENTITY, session="after")
        assert s.check() == []


def test_a_long_reader_leaves_no_lasting_log(tmp_path: Path) -> None:
    """Round 5: while any reader held a transaction the log grew ~130 KB a save and
    never shrank afterwards.  It grows while the reader holds it (SQLite cannot move
    pages a reader may still read), and is cut back once it lets go."""
    import sqlite3

    root = tmp_path / "store"
    with persist.Store(root) as s:
        s.save(cache_of(1)[0], list(range(N)), identity=IDENTITY, session="base")
        reader = sqlite3.connect(root / "index.sqlite")
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM snapshots").fetchone()  # holds its snapshot
        for i in range(40):
            s.save(cache_of(10 + i)[0], list(range(N)), identity=IDENTITY, session=f"t{i % 4}")
        grown = os.lstat(root / "index.sqlite-wal").st_size
        reader.rollback()
        reader.close()
        s.save(cache_of(99)[0], list(range(N)), identity=IDENTITY, session="t0")
        s.gc(1 << 20)  # evicts: a large delete truncates the log
        after = os.lstat(root / "index.sqlite-wal").st_size
    assert grown > JOURNAL_LIMIT, grown  # the reader did hold it
    assert after <= JOURNAL_LIMIT, (grown, after)
    stats = json.loads(persist_cli(root, "stats", "--json").stdout)
    wal = root / "index.sqlite-wal"  # gone once the last connection closed
    assert stats["files"]["wal"] == (wal.stat().st_size if wal.exists() else 0)


FILE_LIMIT_CHILD = """
import resource, sys
import mlx.core as mx
import persist
from tests.golden.cases import IDENTITY
from tests.reliability.test_full_disk import cache_of, N
root = sys.argv[1]
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ
with persist.Store(root) as s:
    for i in range(1, 40):
        try:
            s.save(cache_of(i)[0], list(range(N)), identity=IDENTITY, session=f"s{i}")
        except persist.StoreFullError:
            pass  # typed: the file size limit is this process's full disk
    for name in ["s0", *(e.session for e in s.sessions())]:
        r = s.restore(name, identity=IDENTITY)
        c = r.cache[0]
        want = cache_of(int(name[1:]))[1]
        assert mx.array_equal(c.keys[..., : c.offset, :], want[0]), name
print("ok")
"""


def test_a_file_size_limit_is_a_full_disk_and_reads_go_on(tmp_path: Path) -> None:
    """Outside attack r15, F5: under ``ulimit -f`` (EFBIG) a save failed as SQLite's
    "disk I/O error" (StorageError, not StoreFullError) and so did the restore of a
    committed session: its statistics write, best effort for a full disk only."""
    import subprocess
    import sys

    from tests.helpers import ROOT, pythonpath

    root = tmp_path / "store"
    with persist.Store(root) as s:
        s.save(cache_of(0)[0], list(range(N)), identity=IDENTITY, session="s0")
    limit = 300 << 10  # the attack's `ulimit -f 300`
    out = subprocess.run(
        [sys.executable, "-c", FILE_LIMIT_CHILD, str(root), str(limit)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": pythonpath()},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    with persist.Store(root) as s:
        assert {p.kind for p in s.check()} <= {"stale-pending"}  # a refused save's row
