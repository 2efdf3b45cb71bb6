"""A full disk: telling it apart from damage, and a reserve so that deleting still works.

Round 3 filled a store's disk with saves: after that ``restore`` and
``lookup`` raised a raw ``sqlite3.OperationalError`` (only the statistics
write failed), and ``persist rm`` and ``persist gc`` exited 3, so persist
could not free the space it had filled.  SQLite needs room to delete: its
write-ahead log grows by the pages a transaction changes, and a fresh
connection needs its shared-memory file.  So the store keeps a small
``reserve`` file of real blocks; a write that finds the disk full releases
it and tries once more, and ``collect`` makes it again once files are gone.
Writes of statistics on the read path are best effort (``best_effort``),
dropped and counted when the disk is full.  No mlx.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ReadOnlyStoreError, StoreFullError

if TYPE_CHECKING:
    import logging

__all__ = [
    "RESERVE",
    "RESERVE_BYTES",
    "full_disk",
    "disk_full_error",
    "ensure_reserve",
    "release_reserve",
    "with_room",
    "best_effort",
    "file_size_limit",
    "dropped",
]

T = TypeVar("T")


def _log() -> logging.Logger:
    """persist's logger, imported when there is something to say: ``persist ls`` opens
    the index through this module and needs no logging machinery to list."""
    import logging

    return logging.getLogger("persist")


RESERVE = "reserve"  # in the store root, beside index.sqlite
RESERVE_BYTES = 1 << 20  # a delete's WAL frames and a connection's -shm fit with room to spare
# free bytes before the reserve is made again: it and room for an index to open (-shm)
# and truncate its log, so that making it never leaves the disk full
REMAKE_ROOM = RESERVE_BYTES + (RESERVE_BYTES >> 4)
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_dropped = {"writes": 0}


def dropped() -> int:
    """Statistics writes this process dropped because the disk was full."""
    return _dropped["writes"]


def full_disk(e: BaseException, root: Path | None = None) -> bool:
    """Whether ``e`` says the disk is full (SQLite's SQLITE_FULL, ENOSPC, or an I/O
    error on a disk with no room left: SQLite reports a failed -shm extension so)."""
    if isinstance(e, StoreFullError):
        return True
    if isinstance(e, OSError) and e.errno in DISK_FULL:
        return True
    text = str(e).lower()
    if isinstance(e, sqlite3.Error) and "database or disk is full" in text:
        return True
    if not _io_error(e):
        return False
    if file_size_limit() is not None:  # SQLite reports EFBIG past it as an I/O error
        return True
    if root is not None:
        with contextlib.suppress(OSError):
            st = os.statvfs(root)
            return st.f_bavail * st.f_frsize < RESERVE_BYTES
    return False


def _io_error(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno == errno.EIO) or "disk i/o error" in str(e).lower()


def file_size_limit() -> int | None:
    """This process's file size limit in bytes (``ulimit -f``), None without one.
    Past it every write fails with EFBIG: this process's full disk (attack r15)."""
    try:
        import resource
    except ImportError:  # not on this platform: no such limit
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def disk_full_error(root: Path, e: BaseException) -> StoreFullError:
    return StoreFullError(
        0,
        0,
        f"the disk holding the store at {root} is full ({e}); free space there "
        "(persist rm SESSION or persist gc --max-bytes SIZE work on a full disk)",
    )


def ensure_reserve(root: Path) -> None:
    """Make the reserve if it is missing, once the disk has room for it and a margin
    (``REMAKE_ROOM``): a gc that just freed a little must not take the last bytes back."""
    path = root / RESERVE
    if path.exists() or path.is_symlink():
        return
    try:
        st = os.statvfs(root)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < REMAKE_ROOM:
        return
    tmp = root / f".{RESERVE}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)  # real blocks, not a sparse promise
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def release_reserve(root: Path) -> bool:
    """Give the reserve's blocks back to the disk; whether there was one."""
    path = root / RESERVE
    if path.is_symlink() or not path.is_file():
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def with_room(root: Path, write: Callable[[], T]) -> T:
    """Run ``write``; if the disk is full, release the reserve and run it once more."""
    try:
        return write()
    except Exception as e:
        if not full_disk(e, root):
            raise
        if not release_reserve(root):
            raise disk_full_error(root, e) from e
        _log().warning("persist: the disk is full; using the store's reserve to free space")
    try:
        return write()
    except Exception as e:
        if full_disk(e, root):
            raise disk_full_error(root, e) from e
        raise


def best_effort(write: Callable[..., object], *args: Any, **kwargs: Any) -> bool:
    """``write(*args, **kwargs)``, a statistics write: on a full disk or an I/O error
    of the index it is dropped (counted) instead of failing the read it belongs to (the
    read had its bytes; attack r15); on a read-only store, dropped."""
    try:
        write(*args, **kwargs)
    except ReadOnlyStoreError:
        return False  # a read-only store serves reads: their statistics are not kept
    except Exception as e:
        if not (full_disk(e) or _io_error(e)):
            raise
        _dropped["writes"] += 1
        _log().debug("persist: dropped a statistics write (a full disk or its I/O error): %s", e)
        return False
    return True
