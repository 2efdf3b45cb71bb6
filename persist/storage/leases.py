"""A save's lease: the proof that its writer lives, trusted by ``check`` over pids and clocks.

A writer takes ``tmp/<salt>.lease`` with an exclusive ``flock`` before it
registers its pending row and holds it until that row is gone (committed or
ended).  The kernel drops the lock when the writer dies, however it dies, and
any process on the same kernel sees the lock, whatever its PID namespace or
clock: a pid (another container's is invisible, or someone else's) and an age
(a clock step, a save longer than the grace) told neither.  ``check`` claims
a lease before it ends the pending row and removes the files of a dead save;
a lease it cannot claim is a save in flight.  No mlx.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Lease", "take", "claim", "LEASE_RE", "SALT_TMP_RE", "lease_path"]

LEASE_RE = re.compile(r"([0-9a-f]{12})\.lease")
SALT_TMP_RE = re.compile(r"([0-9a-f]{12})\.[0-9a-f]{16}\.tmp")  # a blob's partial write
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Leases this process holds: where flock is emulated by per-process POSIX locks (NFS),
# the kernel would not keep a check in the saving process from claiming its own.
_mine: set[Path] = set()


@dataclass
class Lease:
    """A held lease: the salt it covers and the open, locked file."""

    salt: str
    path: Path
    fd: int

    def release(self) -> None:
        """Remove the lease file, then let go of the lock (the kernel also does on exit)."""
        if self.fd < 0:
            return
        _mine.discard(self.path)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1


def lease_path(tmp: Path, salt: str) -> Path:
    return tmp / f"{salt}.lease"


def take(tmp: Path) -> Lease:
    """A new salt and its lease, locked.  The file is created and then locked; a checker
    that claimed and removed it in between leaves this lock on a file no one can see,
    so the lock is checked to be on the file at the path, else another salt is tried."""
    for _ in range(16):
        salt = secrets.token_hex(6)
        path = lease_path(tmp, salt)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        except BaseException:  # a Ctrl-C as it returned: a new salt's file, ours to remove
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        try:
            if _lock(fd) and _same(fd, path):
                _mine.add(path)
                return Lease(salt, path, fd)
        except BaseException:  # no lease file left that no one holds (attack r15)
            _mine.discard(path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, f"could not take a save's lease in {tmp}")


@contextlib.contextmanager
def claim(tmp: Path, salt: str, remove: bool = True) -> Iterator[bool]:
    """Hold a dead save's lease while its leftovers are removed: yields False when the
    lease is held (the save is in flight), True when it was free or gone.  With
    ``remove`` a free lease's file is removed at the end, while the lock is still held."""
    path = lease_path(tmp, salt)
    if path in _mine:
        yield False
        return
    try:
        fd = os.open(path, os.O_RDONLY | NOFOLLOW)  # flock needs no write access
    except FileNotFoundError:
        yield True  # never taken (an older persist), or released: no writer holds it
        return
    except OSError as e:
        if e.errno == errno.ELOOP:  # a link planted in tmp/: not a lease persist made
            yield False
            return
        raise
    try:
        if not _lock(fd):
            yield False
            return
        yield True
        if remove and _same(fd, path):
            with contextlib.suppress(OSError):
                os.unlink(path)
    finally:
        os.close(fd)


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in _BUSY:
            return False
        raise
    return True


def _same(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path`` (not removed, not replaced)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
