"""Damaged blobs: find them, and decide what each hurt session keeps.  No mlx.

Round 2's ``check --fix`` removed a whole 1,861-token session for one
flipped byte in one block.  Now a repair keeps what is still valid:

- a trimmable session keeps its longest valid prefix, the blocks before the
  first damaged one (the cut itself is a re-save, done by the engine through
  the ``Cutter`` it hands to ``check_store``: rebuilding a cache needs mlx);
- otherwise (a recurrent session, or a prefix that cannot be cut) its deepest
  valid checkpoint becomes the session;
- only when nothing valid is left is the session removed.

Every session that changed is named, with what it lost, and a one-time
notice is left for the next restore of it (``notices``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import msgpack

from ..errors import CorruptBlobError
from ..format.container import checksum, read_header
from ..format.manifest import blob_manifest
from ..format.opening import open_regular
from ..records import Progress
from ..servable import of_row
from . import writes
from .index import Index
from .rows import SnapshotRow
from .types import Problem

if TYPE_CHECKING:
    import sqlite_utils

    from .blobs import FileBlobs

__all__ = [
    "Hurt",
    "Cutter",
    "damaged",
    "still_live",
    "verify_blob",
    "repair",
    "NOTICE",
    "pop_notice",
    "clear_quarantine",
    "QUARANTINE_DAYS",
]

# (the hurt session's row, tokens to keep) -> True once a session of that many tokens replaced it
Cutter = Callable[[SnapshotRow, int], bool]
NOTICE = "notice/"  # meta keys of one-time notices: NOTICE + json [namespace, name]


@dataclass(frozen=True)
class Hurt:
    """A snapshot that uses a damaged blob, and what can be kept of it."""

    row: SnapshotRow
    first_bad: int | None  # the first damaged block, None if only the tail is
    keep: int  # tokens a cut keeps (0: no cut possible)


def damaged(
    blobs: FileBlobs,
    rows: dict[str, tuple[int, bytes, int, bool]],
    on_disk: set[str],
    *,
    progress: Progress | None = None,
    done: int = 0,
    total: int = 0,
) -> dict[str, str]:
    """Live blobs that are missing or fail their checks: file -> why."""
    bad = {}
    for k, (f, (size, head, _refs, dead)) in enumerate(sorted(rows.items())):
        if progress is not None:
            progress(done + k + 1, total or len(rows))
        if dead:
            continue
        # A blob written after the listing and committed before the rows were read
        # is in this view without being listed: only one missing now is damage.
        if f not in on_disk and not os.path.lexists(blobs.path(f)):
            bad[f] = "blob file is missing"
            continue
        problem = _verify(blobs.path(f), size, head)
        if problem:
            bad[f] = problem
    return bad


def still_live(index: Index, bad: dict[str, str]) -> dict[str, str]:
    """Of ``bad`` (found over check's one view), the blobs still live now.  A save that
    committed after that view may have unreferenced a blob and then deleted its file
    (the write order): missing now, but no longer used, so not damage (attack r13c).
    ``bad`` is a few files on a damaged store, none on a healthy one."""
    return {f: why for f, why in bad.items() if index.blob_head(f) is not None}


def _verify(path: Path, size: int, head: bytes) -> str | None:
    try:
        with open_regular(path) as fh:
            return verify_blob(fh, str(path), size, head)
    except CorruptBlobError as err:  # a FIFO, a device, a link, a folder: not a blob
        return err.detail
    except FileNotFoundError:
        return "blob file is missing"
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


def _users(db: sqlite_utils.Database, files: set[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for f in sorted(files):
        for (sid,) in db.execute(
            "SELECT id FROM snapshots WHERE tail = ? UNION "
            "SELECT snapshot FROM snapshot_blocks WHERE blob = ?",
            [f, f],
        ):
            out.setdefault(sid, set()).add(f)
    return out


def _hurt(db: sqlite_utils.Database, sid: int, bad: set[str]) -> Hurt | None:
    rows = Index.rows_where(db, "id = ?", [sid])
    if not rows:
        return None
    row = rows[0]
    blocks = Index.blocks_in(db, sid)
    first = min((b.idx for b in blocks if b.blob in bad), default=None)
    keep = 0
    if row.trimmable:
        try:
            block = int(msgpack.unpackb(row.manifest, raw=False)["block"])
        except Exception:  # a damaged row: check's row pass reports it
            block = 0
        upto = first if first is not None else row.n_blocks
        keep = upto * block
        rule = of_row(row.trimmable, row.min_resume, row.manifest)  # what a cut may keep
        if not (keep < row.n_tokens and rule.serves(keep, row.n_tokens)):
            keep = 0
    return Hurt(row, first, keep)


def _checkpoint(db: sqlite_utils.Database, row: SnapshotRow, bad: set[str]) -> SnapshotRow | None:
    """The deepest checkpoint of ``row``'s session that no damaged blob serves."""
    cps = Index.rows_where(
        db,
        "namespace = ? AND owner = ? AND role = 'checkpoint' AND n_tokens < ? "
        "ORDER BY n_tokens DESC",
        [row.namespace, row.name, row.n_tokens],
    )
    for cp in cps:
        files = {cp.tail} | {b.blob for b in Index.blocks_in(db, cp.id) if b.blob}
        if not files & bad and _is_prefix(cp, row):
            return cp
    return None


def _is_prefix(cp: SnapshotRow, row: SnapshotRow) -> bool:
    from ..format.tokens import unpack_tokens

    a, b = unpack_tokens(cp.tokens), unpack_tokens(row.tokens)
    return b[: len(a)] == a


def repair(
    index: Index,
    blobs: FileBlobs,
    bad: dict[str, str],
    fix: bool,
    cut: Cutter | None,
) -> list[Problem]:
    """Report every damaged blob and every session it hurts; with ``fix`` keep what is valid,
    remove the rest, and move the damaged files to quarantine."""
    if not bad:
        return []
    files = set(bad)
    with index.read() as db:
        users = _users(db, files)
        hurt = [h for sid in sorted(users) if (h := _hurt(db, sid, files)) is not None]
    out = []
    for f, why in sorted(bad.items()):
        named = sorted(
            {repr(h.row.name) for h in hurt if h.row.name is not None and f in users[h.row.id]}
        )
        used = f"sessions {', '.join(named)}" if named else "no session (only prefixes)"
        out.append(Problem("damaged-blob", f, f"{why}; used by {used}", fix))
    kept: set[str] = set()
    if fix:  # a cut's save must never take a damaged file for a block it can reuse,
        with index.write() as db:  # and its commit collects what it unreferenced: move first
            for f in sorted(files):
                db.execute("UPDATE blobs SET key = 'damaged-' || key WHERE file = ?", [f])
        kept = {f for f in sorted(files) if _keep_aside(blobs, blobs.path(f))}
    for h in hurt:
        if h.row.name is not None:
            out.append(_session(index, h, files, fix, cut))
    if fix:
        with index.write() as db:
            for sid in sorted(_users(db, files)):  # re-read: a cut replaced its own row
                writes.remove(db, sid)
        for f in sorted(files):  # what a cut's commit did not collect already
            p = blobs.path(f)
            if f in kept:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            elif os.path.lexists(p) and not p.is_symlink():
                quarantine(blobs, p)
    return out


def _session(index: Index, h: Hurt, bad: set[str], fix: bool, cut: Cutter | None) -> Problem:
    row, target = h.row, f"session {h.row.name!r} in namespace {h.row.namespace!r}"
    where = (
        f"block {h.first_bad} of {row.n_blocks} damaged"
        if h.first_bad is not None
        else "its tail blob damaged"
    )
    if h.keep and (not fix or (cut is not None and cut(row, h.keep))):
        lost = row.n_tokens - h.keep
        what = f"keeps its first {h.keep} of {row.n_tokens} tokens (loses {lost}: {where})"
        return _changed(index, row, target, what, fix)
    with index.read() as db:
        cp = _checkpoint(db, row, bad)
    if cp is not None:
        if fix:
            with index.write() as db:
                if not Index.rows_where(db, "id = ?", [row.id]):
                    return Problem("session-cut", target, "was saved again meanwhile", True)
                writes.remove(db, row.id)
                db.execute(
                    "UPDATE snapshots SET name = ?, owner = NULL, role = 'session', pinned = ? "
                    "WHERE id = ?",
                    [row.name, int(row.pinned), cp.id],
                )
        lost = row.n_tokens - cp.n_tokens
        what = (
            f"goes back to its checkpoint of {cp.n_tokens} of {row.n_tokens} tokens "
            f"(loses {lost}: {where})"
        )
        return _changed(index, row, target, what, fix)
    what = f"is removed: nothing valid is left (loses all {row.n_tokens} tokens: {where})"
    return _changed(index, row, target, what, fix)


def _changed(index: Index, row: SnapshotRow, target: str, what: str, fix: bool) -> Problem:
    if fix:
        note = f"{target} was repaired by persist check --fix: it {what}"
        with index.write() as db:
            db.execute(
                "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                [NOTICE + json.dumps([row.namespace, row.name]), note],
            )
    return Problem("session-cut", target, what if fix else f"with --fix it {what}", fix)


def pop_notice(index: Index, namespace: str, name: str) -> str | None:
    """The one-time notice of a session that a repair cut, removed from the index as read."""
    key = NOTICE + json.dumps([namespace, name])
    with index.read() as db:
        got = db.execute("SELECT value FROM meta WHERE key = ?", [key]).fetchone()
    if got is None:
        return None
    with contextlib.suppress(Exception), index.write() as db:  # best effort: a full disk
        db.execute("DELETE FROM meta WHERE key = ?", [key])
    return str(got[0])


def _keep_aside(blobs: FileBlobs, p: Path) -> bool:
    """A hard link of a damaged file in quarantine, while a cut may still read its valid part."""
    if p.is_symlink() or not p.is_file():
        return False
    q = blobs.root / "quarantine"
    with contextlib.suppress(FileExistsError):
        q.mkdir(mode=0o700)
    try:
        os.link(p, q / f"{int(time.time())}-{p.name}", follow_symlinks=False)
    except OSError:
        return False
    return True


def quarantine(blobs: FileBlobs, p: Path) -> None:
    """Move a damaged or misplaced file out of the store's way (``gc`` clears it later)."""
    q = blobs.root / "quarantine"
    with contextlib.suppress(FileExistsError):
        q.mkdir(mode=0o700)
    with contextlib.suppress(FileNotFoundError):
        os.replace(p, q / f"{int(time.time())}-{p.name}")


QUARANTINE_DAYS = 14.0  # how long gc keeps what check --fix set aside, for a post-mortem


def clear_quarantine(root: Path, *, dry_run: bool = False, now: float | None = None) -> int:
    """Delete quarantined files older than QUARANTINE_DAYS (by the time in their name)."""
    q, now = root / "quarantine", time.time() if now is None else now
    gone = 0
    for p in sorted(q.iterdir()) if q.is_dir() and not q.is_symlink() else []:
        stamp = p.name.split("-", 1)[0]
        if not stamp.isdigit() or now - int(stamp) < QUARANTINE_DAYS * 86400:
            continue
        if not dry_run:
            with contextlib.suppress(FileNotFoundError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        gone += 1
    return gone
