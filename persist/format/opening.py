"""Opening files for reading: regular files only, never a wait on a FIFO or a device.

A FIFO planted where a blob belongs (or given to ``persist inspect``) made
every plain ``open`` block forever waiting for a writer.  Every file persist
reads is opened here: ``O_NONBLOCK`` so the open itself cannot wait,
``O_NOFOLLOW`` inside a store (a link there is never followed), then
``fstat`` on the open descriptor (no race with a rename) and anything that
is not a regular file is refused, typed.  No mlx.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

from ..errors import CorruptBlobError, InvalidArgumentError, PersistError, StorageError

__all__ = ["open_regular", "user_reads", "file_kind", "MAX_COMPONENT"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
MAX_COMPONENT = 255  # bytes in one path component (NAME_MAX on Linux and macOS)


def file_kind(mode: int) -> str:
    """What a file is, in words, for an error message."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISREG, "a regular file"),
    ):
        if test(mode):
            return name
    return "a file of an unknown kind"


def open_regular(path: str | os.PathLike[str], *, user: bool = False) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file.

    ``user``: a file the user named (it may be a link to a regular file; a
    refusal is InvalidArgumentError, and a missing file StorageError).  A
    store's own file (the default) is never followed through a link and a
    refusal is CorruptBlobError, damage in the store; a missing one raises
    FileNotFoundError for the caller to judge (a concurrent delete is not damage).
    """
    where = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | CLOEXEC | (0 if user else NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        if user:
            raise StorageError(f"cannot read {where}", e) from e
        raise
    except OSError as e:
        why = _why(e, user)
        if why is not None:
            _refuse(where, why, user)
        raise StorageError(f"cannot read {where}", e) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse(where, f"is {file_kind(mode)}, not a regular file", user)
        # Back to blocking reads: O_NONBLOCK is only there so the open cannot wait.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


@contextlib.contextmanager
def user_reads(where: str) -> Iterator[None]:
    """Reads of a file the user named: what the system refuses once it is open (EIO
    from ``/proc/self/mem``, a failing disk, a network mount that dropped the file) is
    StorageError naming it, never a bare OSError (attack 38d, finding G)."""
    try:
        yield
    except PersistError:
        raise
    except OSError as e:
        raise StorageError(f"cannot read {where}", e) from e


def _why(e: OSError, user: bool) -> str | None:
    """The damage an open failed on, or None for what the system refused (permissions, I/O)."""
    if e.errno == errno.ELOOP and not user:
        return "is a symbolic link; persist never follows links in a store"
    if e.errno == errno.ENOTDIR:
        return "a folder on its path is not a directory"
    if e.errno == errno.EISDIR:
        return "is a directory, not a regular file"
    if e.errno in (errno.ELOOP, errno.ENAMETOOLONG):
        return e.strerror or str(e)
    return None


def _refuse(where: str, why: str, user: bool) -> None:
    if user:
        raise InvalidArgumentError(f"{where}: {why}")
    raise CorruptBlobError(where, why)
