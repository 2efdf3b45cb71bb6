"""Folders only their owner may change, as ssh treats ``~/.ssh``: the rule the store
(``storage.access``) and the weights-digest memo (``weights_memo``) share.  Imports
nothing of persist.

Round 5: a world-writable store ``blobs/`` was refused while a world-writable
``$PERSIST_HOME/identity/`` (the remembered weights digests) was trusted; a local
user planted model A's digest under model B's files, and B resumed A's session.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = ["GROUP_ENV", "private_mkdir", "unsafe", "unsafe_path"]

GROUP_ENV = "PERSIST_GROUP_STORE"  # "1": the members of the folder's group share it


def private_mkdir(path: Path) -> None:
    """Make ``path`` and every missing folder above it 0700 (``mkdir -p`` gave 0755)."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)


def unsafe(st: os.stat_result, group: bool) -> str | None:
    """Why another user could change what ``st`` describes, or None.  ``group``: the
    members of its group may (``PERSIST_GROUP_STORE=1``), others never."""
    uid = os.geteuid()
    if st.st_mode & stat.S_IWOTH:
        return "can be written by every user"
    if group:
        if st.st_gid not in {os.getegid(), *os.getgroups()}:
            return f"belongs to group {st.st_gid}, not one of yours ({GROUP_ENV}=1)"
        return None
    if st.st_uid != uid:
        return f"is owned by user {st.st_uid}, not by you ({uid})"
    if st.st_mode & stat.S_IWGRP:
        return "can be written by its group"
    return None


def unsafe_path(path: Path) -> str | None:
    """``unsafe`` for a path, judged where a link leads; None if it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return unsafe(st, os.environ.get(GROUP_ENV) == "1")
