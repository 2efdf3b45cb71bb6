"""``Store.check``: reconcile the index with the files, and repair on request.

Reads every blob completely and verifies every checksum, so a flipped byte
anywhere is reported.  Repairs never touch healthy sessions: damaged blobs
are moved to ``quarantine/`` together with the snapshots that used them,
orphans are deleted, reference counts are recomputed.  No mlx.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

from ..errors import CorruptBlobError
from ..format.opening import file_kind
from ..records import Progress
from . import full, leases, writes
from .access import unsafe_part
from .blobs import FILE_RE, FileBlobs
from .check_damage import Cutter, damaged, quarantine, repair, still_live, verify_blob
from .check_tmp import TMP_GRACE_SECONDS, tmp_problems
from .index import Index
from .rows import listed_info, row_digest
from .types import Problem

__all__ = ["check_store", "tidy", "verify_blob", "TMP_GRACE_SECONDS"]


def check_store(
    index: Index,
    blobs: FileBlobs,
    fix: bool,
    progress: Progress | None = None,
    cut: Cutter | None = None,
) -> list[Problem]:
    """Every problem of the store; with ``fix`` repaired where it can be.

    One pass over the files and one over the rows (linear in both);
    ``progress(done, total)`` counts blobs verified and rows checked.
    ``cut`` re-saves a damaged trimmable session as its valid prefix.
    """
    problems: list[Problem] = []
    problems += _sqlite(index)
    if any(p.kind == "index-corrupt" for p in problems):
        return problems
    problems += _folders(blobs, fix)
    problems += _reserve(blobs, fix)
    problems += _links(blobs)
    problems += _unsafe_parts(blobs)
    problems += tmp_problems(blobs, fix)
    # Files first, then blob rows and pending saves in one read transaction:
    # a file listed here is either committed in that view (it has a row) or
    # its save's pending row, registered before the file existed, is there.
    on_disk = set(blobs.files())
    rows, pending = index.blob_rows_and_pending()
    problems += _strays(blobs, fix, rows)
    with index.read() as db:
        n_rows = int(db.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0])
    total = len(rows) + n_rows
    problems += _orphans(
        index, blobs, rows, pending=pending, on_disk=on_disk, fix=fix, n_snapshots=n_rows
    )
    bad = damaged(blobs, rows, on_disk, progress=progress, done=0, total=total)
    bad = still_live(index, bad)  # a save's commit may have collected some meanwhile
    problems += repair(index, blobs, bad, fix, cut)
    problems += _rows(index, fix, progress, len(rows), total)
    problems += _refcounts(index, fix)
    if fix:
        dead = index.collect()
        for f in dead:
            blobs.delete(f)
        index.forget(dead)
    return problems


def tidy(index: Index, blobs: FileBlobs) -> list[Problem]:
    """Remove what killed writers left (partial writes, pending rows and blob files of
    saves whose lease is free, dead blobs' files), as ``check --fix`` would, without
    reading a blob: ``persist serve`` runs it at start, so no cron job is needed.
    Saves in flight in other processes (their leases held) are left alone."""
    problems = tmp_problems(blobs, True)
    on_disk = set(blobs.files())  # listed before the rows are read, as check_store
    rows, pending = index.blob_rows_and_pending()
    with index.read() as db:
        n_rows = int(db.execute("SELECT COUNT(*) FROM snapshots").fetchone()[0])
    orphans = _orphans(
        index, blobs, rows, pending=pending, on_disk=on_disk, fix=True, n_snapshots=n_rows
    )
    return problems + orphans


def _sqlite(index: Index) -> list[Problem]:
    try:
        with index.read() as db:
            rows = [r[0] for r in db.execute("PRAGMA integrity_check")]
    except CorruptBlobError as e:  # too damaged to check: reported, not raised
        rows = [e.detail]
    if rows == ["ok"]:
        return []
    hint = "to save what SQLite can still read: sqlite3 index.sqlite .recover > recovered.sql"
    return [Problem("index-corrupt", "index.sqlite", "; ".join(rows[:5]) + "; " + hint)]


def _folders(blobs: FileBlobs, fix: bool) -> list[Problem]:
    """``blobs/`` or ``tmp/`` that is not a folder: moved to quarantine, the folder made again.

    A link is reported by ``_links`` and left; a missing folder is made again.
    """
    out = []
    for d in (blobs.blobs, blobs.tmp):
        try:
            mode = d.lstat().st_mode
        except FileNotFoundError:
            if fix:
                d.mkdir(mode=0o700, exist_ok=True)
            out.append(Problem("not-a-folder", str(d), "is missing", fix))
            continue
        if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
            continue
        if fix:
            quarantine(blobs, d)
            d.mkdir(mode=0o700, exist_ok=True)
        what = f"is {file_kind(mode)}, not a folder"
        out.append(Problem("not-a-folder", str(d), f"{what}; every file it held is lost", fix))
    for d in _odd_subfolders(blobs):  # blobs/<ab> made a file: put() makes the folder again
        if fix:
            quarantine(blobs, d)
        what = f"is {file_kind(d.lstat().st_mode)}, not a folder" if not fix else "set aside"
        out.append(Problem("not-a-folder", str(d), f"{what}; every blob it held is lost", fix))
    return out


def _reserve(blobs: FileBlobs, fix: bool) -> list[Problem]:
    """A FIFO, folder or device where the reserve belongs: a full disk could not free
    it, so ``rm`` and ``gc`` would find no room to delete with.  Set aside, made again."""
    path = blobs.root / full.RESERVE
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return []  # made again when the store opens
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):  # a link: reported by _links, left
        return []
    if fix:
        quarantine(blobs, path)
        full.ensure_reserve(blobs.root)
    what = f"is {file_kind(mode)}, not the reserve a full disk frees to delete with"
    return [Problem("not-a-file", str(path), what, fix)]


SUBDIR_RE = re.compile(r"[0-9a-f]{2}")


def _odd_subfolders(blobs: FileBlobs) -> list[Path]:
    if not blobs.blobs.is_dir() or blobs.blobs.is_symlink():
        return []
    return [
        Path(e.path)
        for e in sorted(os.scandir(blobs.blobs), key=lambda e: e.name)
        if SUBDIR_RE.fullmatch(e.name)
        and not e.is_dir(follow_symlinks=False)
        and not e.is_symlink()
    ]


def _links(blobs: FileBlobs) -> list[Problem]:
    return [
        Problem("symlink", str(p), "a symbolic link inside the store; persist leaves it", False)
        for p in blobs.links()
    ]


def _unsafe_parts(blobs: FileBlobs) -> list[Problem]:
    """``blobs/ab/`` folders and blob files another user owns or can write: a restore
    refuses them; reported, never fixed or deleted here (whose they are is the owner's
    call, and deleting another user's file would lose what it holds)."""
    out: list[Problem] = []
    if blobs.blobs.is_symlink():
        return out
    for path, st in blobs.parts():
        why = unsafe_part(st)
        if why is not None:
            out.append(Problem("unsafe", str(path), f"{why}; a restore refuses it", False))
    return out


def _strays(blobs: FileBlobs, fix: bool, rows: Mapping[str, object]) -> list[Problem]:
    """Files under blobs/ that are not blobs where they lie.

    A regular file with a name persist writes (a blob name in the wrong
    directory) is moved to quarantine; anything else is reported and left
    as it is: persist never deletes or moves what it did not name.
    """
    out = []
    for p in blobs.stray_files():
        if p.is_symlink():
            continue  # reported by _links
        if p.parent == blobs.blobs and SUBDIR_RE.fullmatch(p.name):
            continue  # a blob folder made a file: reported by _folders
        name = p.name.removesuffix(".safetensors")
        if name in rows and name[:2] == p.parent.name and p.parent.parent == blobs.blobs:
            continue  # a listed blob that is not a regular file: damage, judged below
        ours = FILE_RE.fullmatch(p.name.removesuffix(".safetensors")) and p.is_file()
        if ours and fix:
            quarantine(blobs, p)
        detail = "a blob name in the wrong place" if ours else "not a name persist writes; left"
        out.append(Problem("stray-file", str(p), detail, bool(ours and fix)))
    return out


def _orphans(
    index: Index,
    blobs: FileBlobs,
    rows: dict[str, tuple[int, bytes, int, bool]],
    *,
    pending: dict[str, tuple[int, float]],
    on_disk: set[str],
    fix: bool,
    n_snapshots: int,
) -> list[Problem]:
    # An index that vouches for nothing (no snapshot, no blob, no save in flight)
    # beside blob files lost its contents: those files are not orphans, and
    # deleting them would make the loss irreversible.
    if on_disk and not rows and not pending and not n_snapshots:
        detail = (
            f"{len(on_disk)} blob files but an index that lists none: the index was lost "
            "or replaced; persist deletes nothing it cannot account for (put the old "
            "index.sqlite back, or move the store away to start afresh)"
        )
        return [Problem("unvouched-blobs", str(blobs.blobs), detail, False)]
    out, dead = [], set()
    for s in sorted(pending):
        with leases.claim(blobs.tmp, s, remove=fix) as free:
            if not free:
                continue  # a save in flight: its writer holds the lease
            # ended before its files go: that save can never commit now
            if not fix or index.end_pending(s):
                dead.add(s)
    # Read again after the ends: a save that committed since the first read has rows
    # now, and one still pending (its lease held, or registered since) keeps its files.
    rows, now_pending = index.blob_rows_and_pending()
    for s in sorted(dead):
        if fix or s in now_pending:  # not one that committed meanwhile
            out.append(Problem("stale-pending", s, "a save that never committed", fix))
    for f in sorted(on_disk):
        row, salt = rows.get(f), f.split(".")[1]
        if row is None and salt in now_pending and salt not in dead:
            continue
        # a save beside this check collects what its commit unreferenced: a blob
        # awaiting that is no problem unless asked to fix (any later save or gc
        # collects it), and one gone since the listing was collected (attack r14)
        if (row is not None and row[3] and not fix) or not os.path.lexists(blobs.path(f)):
            continue
        if row is None or row[3]:
            if fix:
                blobs.delete(f)
            what = "no index entry" if row is None else "unreferenced, awaiting deletion"
            out.append(Problem("orphan-blob", f, what, fix))
    if fix:
        index.forget([f for f, r in rows.items() if r[3]])
    return out


def _rows(
    index: Index, fix: bool, progress: Progress | None, done: int, total: int
) -> list[Problem]:
    """Snapshot rows whose immutable fields no longer match their checksum.

    Rows and their blocks are read in one transaction, and a fix re-checks
    the row inside the transaction that removes it (ids are never reused).
    """
    bad = []
    with index.read() as db:
        for k, r in enumerate(Index.rows_where(db, "1=1 ORDER BY id", [])):
            if progress is not None:
                progress(done + k + 1, total)
            if row_digest(r, Index.blocks_in(db, r.id)) != r.row_xxh3:
                bad.append((r.id, r.name, r.namespace, "index row does not match its checksum"))
            elif (why := listed_info(r).damaged) is not None:  # fields outside the checksum
                bad.append((r.id, r.name, r.namespace, why))
    out = []
    for sid, name, ns, why in bad:
        if fix:
            with index.write() as db:
                again = Index.rows_where(db, "id = ?", [sid])  # ids are never reused
                if again and (Index.damaged_rows(db, sid) or listed_info(again[0]).damaged):
                    writes.remove(db, sid)
        target = f"snapshot {sid}" if name is None else f"session {name!r} in namespace {ns!r}"
        out.append(Problem("damaged-row", target, f"{why}; it is removed" if fix else why, fix))
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
