"""``Store.check``: reconcile the index with the files, and repair on request.

Reads every blob completely and verifies every checksum, so a flipped byte
anywhere is reported.  Repairs never touch healthy sessions: damaged blobs
are moved to ``quarantine/`` together with the snapshots that used them,
orphans are deleted, reference counts are recomputed.  No mlx.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path
from typing import BinaryIO

from ..errors import CorruptBlobError
from ..format.container import checksum, read_header
from ..format.manifest import blob_manifest
from ..records import Progress
from . import writes
from .blobs import FILE_RE, FileBlobs
from .index import Index
from .types import Problem

__all__ = ["check_store", "TMP_GRACE_SECONDS"]

TMP_GRACE_SECONDS = 3600.0  # a tmp file this old, or whose writer is gone, is debris


def check_store(
    index: Index, blobs: FileBlobs, fix: bool, progress: Progress | None = None
) -> list[Problem]:
    problems: list[Problem] = []
    problems += _sqlite(index)
    if any(p.kind == "index-corrupt" for p in problems):
        return problems
    problems += _links(blobs)
    problems += _tmp(blobs, fix)
    problems += _strays(blobs, fix)
    # Files first, then blob rows and pending saves in one read transaction:
    # a file listed here is either committed in that view (it has a row) or
    # its save's pending row, registered before the file existed, is there.
    on_disk = set(blobs.files())
    rows, pending = index.blob_rows_and_pending()
    problems += _orphans(index, blobs, rows, pending, on_disk, fix)
    bad = _damaged(blobs, rows, on_disk, progress)
    problems += _quarantine(index, blobs, bad, fix)
    problems += _rows(index, fix)
    problems += _refcounts(index, fix)
    if fix:
        dead = index.collect()
        for f in dead:
            blobs.delete(f)
        index.forget(dead)
    return problems


def _sqlite(index: Index) -> list[Problem]:
    with index.read() as db:
        rows = [r[0] for r in db.execute("PRAGMA integrity_check")]
    if rows == ["ok"]:
        return []
    return [Problem("index-corrupt", "index.sqlite", "; ".join(rows[:5]))]


TMP_RE = re.compile(r"(\d+)-[0-9a-f]{16}\.tmp")


def _links(blobs: FileBlobs) -> list[Problem]:
    return [
        Problem("symlink", str(p), "a symbolic link inside the store; persist leaves it", False)
        for p in blobs.links()
    ]


def _tmp(blobs: FileBlobs, fix: bool) -> list[Problem]:
    """Partial writes whose writer is gone; only names persist writes, only regular files."""
    out = []
    now = time.time()
    for p in blobs.tmp_files():
        m = TMP_RE.fullmatch(p.name)
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # renamed into place (or removed) while we looked
        if stat.S_ISLNK(st.st_mode):
            continue  # reported by _links
        if m is None or not stat.S_ISREG(st.st_mode):
            out.append(Problem("stray-file", str(p), "not a name persist writes; left", False))
            continue
        age = now - st.st_mtime
        if _alive(int(m.group(1))) and age < TMP_GRACE_SECONDS:
            continue  # another process is writing it
        if fix:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        out.append(Problem("orphan-tmp", str(p), f"partial write, {age:.0f} s old", fix))
    return out


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _strays(blobs: FileBlobs, fix: bool) -> list[Problem]:
    """Files under blobs/ that are not blobs where they lie.

    A regular file with a name persist writes (a blob name in the wrong
    directory) is moved to quarantine; anything else is reported and left
    as it is: persist never deletes or moves what it did not name.
    """
    out = []
    for p in blobs.stray_files():
        if p.is_symlink():
            continue  # reported by _links
        ours = FILE_RE.fullmatch(p.name.removesuffix(".safetensors")) and p.is_file()
        if ours and fix:
            _quarantine_file(blobs, p)
        detail = "a blob name in the wrong place" if ours else "not a name persist writes; left"
        out.append(Problem("stray-file", str(p), detail, bool(ours and fix)))
    return out


def _orphans(
    index: Index,
    blobs: FileBlobs,
    rows: dict[str, tuple[int, bytes, int, bool]],
    pending: dict[str, tuple[int, float]],
    on_disk: set[str],
    fix: bool,
) -> list[Problem]:
    out = []
    now = time.time()
    in_flight = {
        s for s, (pid, made) in pending.items() if _alive(pid) and now - made < TMP_GRACE_SECONDS
    }
    # Never delete a file younger than the oldest save still in flight.
    oldest = min((pending[s][1] for s in in_flight), default=now)
    for f in sorted(on_disk):
        row = rows.get(f)
        if row is None and f.split(".")[1] in in_flight:
            continue  # a save in another process has not committed yet
        if row is None and _mtime(blobs.path(f)) >= oldest - 1:
            continue
        if row is None or row[3]:
            if fix:
                blobs.delete(f)
            what = "no index entry" if row is None else "unreferenced, awaiting deletion"
            out.append(Problem("orphan-blob", f, what, fix))
    stale = [s for s in pending if s not in in_flight]
    for s in stale:
        if fix:
            index.end_pending(s)
        out.append(Problem("stale-pending", s, "a save that never committed", fix))
    if fix:
        index.forget([f for f, r in rows.items() if r[3]])
    return out


def _mtime(p: Path) -> float:
    try:
        return p.lstat().st_mtime
    except FileNotFoundError:
        return 0.0


def _damaged(
    blobs: FileBlobs,
    rows: dict[str, tuple[int, bytes, int, bool]],
    on_disk: set[str],
    progress: Progress | None = None,
) -> dict[str, str]:
    bad = {}
    for k, (f, (size, head, _refs, dead)) in enumerate(sorted(rows.items())):
        if progress is not None:
            progress(k + 1, len(rows))
        if dead:
            continue
        # A blob written after the listing and committed before the rows were read
        # is in this view without being listed: only one missing now is damage.
        if f not in on_disk and not blobs.path(f).exists():
            bad[f] = "blob file is missing"
            continue
        problem = _verify(blobs.path(f), size, head)
        if problem:
            bad[f] = problem
    return bad


def _verify(path: Path, size: int, head: bytes) -> str | None:
    try:
        with open(path, "rb") as fh:
            return verify_blob(fh, str(path), size, head)
    except OSError as err:
        return f"unreadable: {err}"


def verify_blob(
    fh: BinaryIO, where: str, size: int, head: bytes, length: int | None = None
) -> str | None:
    """What is wrong with an open blob file (size, header, every tensor), or None;
    ``length`` for bytes that are not a file yet (``io.BytesIO``)."""
    try:
        header = read_header(fh, where, length)
        if header.file_size != size or header.digest != head:
            return "size or header does not match the index"
        sums = blob_manifest(header, where)
        for key, e in header.tensors.items():
            fh.seek(e.start)
            if checksum(fh.read(e.end - e.start)) != sums[key]:
                return f"checksum mismatch in tensor {key!r}"
    except CorruptBlobError as err:
        return err.detail
    return None


def _quarantine(index: Index, blobs: FileBlobs, bad: dict[str, str], fix: bool) -> list[Problem]:
    out = []
    for f, why in bad.items():
        with index.read() as db:
            users = sorted(
                {
                    r[0]
                    for r in db.execute(
                        "SELECT id FROM snapshots WHERE tail = ? UNION "
                        "SELECT snapshot FROM snapshot_blocks WHERE blob = ?",
                        [f, f],
                    )
                }
            )
        if fix:
            with index.write() as db:
                for sid in users:
                    writes.remove(db, sid)
            if blobs.path(f).exists():
                _quarantine_file(blobs, blobs.path(f))
        out.append(Problem("damaged-blob", f, f"{why}; used by snapshots {users}", fix))
    return out


def _quarantine_file(blobs: FileBlobs, p: Path) -> None:
    q = blobs.root / "quarantine"
    q.mkdir(mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.replace(p, q / f"{int(time.time())}-{p.name}")


def _rows(index: Index, fix: bool) -> list[Problem]:
    """Snapshot rows whose immutable fields no longer match their checksum.

    Rows and their blocks are read in one transaction, and a fix re-checks
    the row inside the transaction that removes it (ids are never reused).
    """
    with index.read() as db:
        bad = [(r.id, why) for r, why in Index.damaged_rows(db)]
    out = []
    for sid, why in bad:
        if fix:
            with index.write() as db:
                if any(r.id == sid for r, _ in Index.damaged_rows(db, sid)):
                    writes.remove(db, sid)
        out.append(Problem("damaged-row", f"snapshot {sid}", why, fix))
    return out


def _refcounts(index: Index, fix: bool) -> list[Problem]:
    # Read and repair in one write transaction: counts read earlier could be
    # stale by the time they were written back, with other processes saving.
    with index.write() if fix else index.read() as db:
        actual: dict[str, int] = {}
        for (f,) in db.execute("SELECT tail FROM snapshots"):
            actual[f] = actual.get(f, 0) + 1
        for (f,) in db.execute("SELECT blob FROM snapshot_blocks WHERE blob IS NOT NULL"):
            actual[f] = actual.get(f, 0) + 1
        rows = db.execute("SELECT file, refs, dead FROM blobs").fetchall()
        dangling = db.execute(
            "SELECT id FROM snapshots WHERE tail NOT IN (SELECT file FROM blobs WHERE dead = 0) "
            "UNION SELECT snapshot FROM snapshot_blocks WHERE blob IS NOT NULL "
            "AND blob NOT IN (SELECT file FROM blobs WHERE dead = 0)"
        ).fetchall()
        wrong = [
            (f, refs, actual.get(f, 0))
            for f, refs, dead in rows
            if not dead and refs != actual.get(f, 0)
        ]
        if fix:
            for (sid,) in dangling:
                writes.remove(db, sid)
            for f, _, want in wrong:
                db.execute(
                    "UPDATE blobs SET refs = ?, dead = ? WHERE file = ?", [want, int(want == 0), f]
                )
    out = [
        Problem("dangling-snapshot", f"snapshot {sid}", "references a missing blob", fix)
        for (sid,) in dangling
    ]
    out += [
        Problem("bad-refcount", f, f"refs {refs}, referenced {want} times", fix)
        for f, refs, want in wrong
    ]
    return out
