"""Files an option names (``--api-keys``, ``--public-prefix``, ``--tier-key-file``):
regular files only, read up to a stated bound.

Round 5: ``persist serve --api-keys /dev/zero`` read until memory ran out (a
MemoryError, exit 3; an OOM kill without a ulimit), and a FIFO with no writer
held the start forever.  Every such file is opened without waiting
(``O_NONBLOCK``: a FIFO's open cannot block), judged by ``fstat`` on the open
descriptor, refused unless it is a regular file, and read to at most its
bound: one typed line, exit 1.  Pure: no mlx.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InvalidArgumentError

__all__ = ["read_option_file"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def read_option_file(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of ``the {what} file {path}``: InvalidArgumentError when it cannot be
    read, is not a regular file (a device, a FIFO, a socket) or holds more than
    ``limit`` bytes; never more than ``limit + 1`` bytes are read."""
    where = f"the {what} file {Path(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {where}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{where} is {_kind(st.st_mode)}, not a regular file")
        too_long = InvalidArgumentError(
            f"{where} is too long: at most {limit:,} bytes are read from it"
        )
        if st.st_size > limit:  # refused unread
            raise too_long
        try:
            data = f.read(limit + 1)  # a file that grew since the fstat
        except OSError as e:
            raise InvalidArgumentError(f"cannot read {where}: {e.strerror or e}") from None
    if len(data) > limit:
        raise too_long
    return data
