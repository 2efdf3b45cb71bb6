"""Who may change a store: its owner alone (as ssh treats ``~/.ssh``), and a store no
one may change (read-only), which still lists, shows, exports and restores.

Round 5: a store root or ``blobs/`` that another local user created or could
write was used as it was; that user swapped in an index and blobs of their
own, and the victim's next ``generate --session`` resumed the planted text.
No mlx.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..errors import ReadOnlyStoreError, UnsafeStoreError
from ..private_files import GROUP_ENV, group_mode, private_mkdir, unsafe, unsafe_above

if TYPE_CHECKING:
    import sqlite_utils

__all__ = [
    "GROUP_ENV",
    "check_owner",
    "check_part",
    "unsafe_part",
    "private_mkdir",
    "read_only",
    "connect_read_only",
]

CHECKED = ("", "blobs", "tmp", "index.sqlite", "index.sqlite-wal", "index.sqlite-shm")


def check_owner(root: Path) -> None:
    """Refuse a store whose root, ``blobs/``, ``tmp/`` or index another user owns or
    can write (with ``PERSIST_GROUP_STORE=1``: any member of its group, not others).
    A link among them is judged by what it leads to (a link's own mode is always 0777):
    a read follows it (writes, ``schema.connect`` and ``check`` refuse it where it stands).
    Every folder above the root, and above where a link leads, must be one no other
    user can rename entries of (``private_files.unsafe_above``)."""
    group = group_mode()
    for name in CHECKED:
        p = root / name if name else root
        try:  # the root may be a link (a store on another disk): judged where it leads
            st = os.stat(p) if not name else os.lstat(p)
            if stat.S_ISLNK(st.st_mode):  # writes refuse links inside; reads went through
                target = Path(os.path.realpath(p))
                st = os.stat(target)
                shown, fixed = f"{p} (a link to {target})", target
            else:
                shown, fixed = str(p), p
        except FileNotFoundError:  # a dangling link: refused where it stands
            continue
        why = unsafe(st, group)
        if why is not None:
            raise UnsafeStoreError(shown, why, _fix(fixed, st, group))
        if not name or stat.S_ISLNK(os.lstat(p).st_mode):
            _check_above(p)


def unsafe_part(st: os.stat_result) -> str | None:
    """Why another user could change a part inside ``blobs/`` (a ``blobs/ab/``
    folder, a blob file), by the rule ``check_owner`` applies to the store's root."""
    return unsafe(st, group_mode())


def check_part(path: Path, st: os.stat_result) -> None:
    """Refuse a ``blobs/ab/`` folder or blob file another user owns or can write
    (attack 38, finding 9: they could delete or replace it, and so lose sessions)."""
    why = unsafe_part(st)
    if why is not None:
        raise UnsafeStoreError(str(path), why, _fix(path, st, group_mode()))


def _check_above(p: Path) -> None:
    """The folders above the root (and above where a linked part leads), as ssh checks
    those above ``~/.ssh``: one another user could rename entries of could put a
    store of their own where this one was checked, before it is read by path."""
    above = unsafe_above(p)
    if above is None:
        return
    folder, st, why = above
    fix = (
        f"chmod go-w {folder} (or chmod +t {folder}, as /tmp is), or move the store "
        "into a folder only you (or root) can change"
    )
    if st.st_uid not in (0, os.geteuid()):
        fix = "move the store into a folder that you or root own"
    raise UnsafeStoreError(f"{folder}, a folder above it,", why, fix)


def _fix(p: Path, st: os.stat_result, group: bool) -> str:
    if not group and st.st_uid != os.geteuid():
        return (
            f"if you trust it: chown -R {os.geteuid()} {p}; or share it with a group "
            f"(chgrp -R GROUP, chmod -R g+w, o-w) and set {GROUP_ENV}=1"
        )
    if group:
        return f"chmod o-w {p}, and its group one of yours"
    return f"chmod go-w {p} (or, to share it with a group, set {GROUP_ENV}=1)"


def read_only(root: Path) -> bool:
    """Whether this process cannot change the store: a read-only mount, or a root or
    index it may not write (a root user may write anything but a read-only mount)."""
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return True
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        return False
    index = root / "index.sqlite"
    return not os.access(root, os.W_OK) or (index.exists() and not os.access(index, os.W_OK))


def connect_read_only(path: Path) -> sqlite_utils.Database:
    """The index opened for reading alone: no journal-mode switch, no migration, no
    -shm made.  ``immutable`` (SQLite reads no lock and no log) only when there is no
    write-ahead log to miss; a store left with one must be opened writable once."""
    from .lost import damaged_index
    from .schema import SCHEMA_VERSION, Database

    wal = path.with_name(path.name + "-wal")
    uris = [f"file:{quote(str(path))}?mode=ro"]
    if not wal.exists() or wal.stat().st_size == 0:
        uris.append(uris[0] + "&immutable=1")
    error: sqlite3.Error | None = None
    for uri in uris:
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
            conn.text_factory = lambda b: b.decode("utf-8", "replace")  # as schema.connect
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        except sqlite3.Error as e:
            error = e
            continue
        if row is None or row[0] != str(SCHEMA_VERSION):
            conn.close()
            why = f"its index (version {row and row[0]}) needs an upgrade, which writes"
            raise ReadOnlyStoreError(path.parent, why)
        return Database(conn)
    if isinstance(error, sqlite3.OperationalError) and "unable to open" in str(error):
        why = "it holds a write-ahead log that only a writable open merges (run any "
        raise ReadOnlyStoreError(path.parent, why + "persist command on it writable once)")
    raise damaged_index(path, f"the index is not a usable SQLite file: {error}")
