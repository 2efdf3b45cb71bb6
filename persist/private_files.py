"""Folders only their owner may change, as ssh treats ``~/.ssh``: the rule the store
(``storage.access``) and the weights-digest memo (``weights_memo``) share.  Imports
nothing of persist.

Round 5: a world-writable store ``blobs/`` was refused while a world-writable
``$PERSIST_HOME/identity/`` (the remembered weights digests) was trusted; a local
user planted model A's digest under model B's files, and B resumed A's session.
Then a 0700 memo folder inside a 0777 parent was renamed aside and replaced by a
link between the check and the read: a folder is private only if every folder
above it is too (``unsafe_above``), and a check holds only for what was opened.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

__all__ = ["GROUP_ENV", "group_mode", "private_mkdir", "unsafe", "unsafe_above", "unsafe_path"]

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


def group_mode() -> bool:
    """Whether the members of a folder's group share it (``PERSIST_GROUP_STORE=1``)."""
    return os.environ.get(GROUP_ENV) == "1"


def _my_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def unsafe(st: os.stat_result, group: bool) -> str | None:
    """Why another user could change what ``st`` describes, or None.  ``group``: the
    members of its group may (``PERSIST_GROUP_STORE=1``), others never."""
    uid = os.geteuid()
    if st.st_mode & stat.S_IWOTH:
        return "can be written by every user"
    if group:
        if st.st_gid not in _my_groups():
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
    return unsafe(st, group_mode())


def unsafe_parent(st: os.stat_result, group: bool) -> str | None:
    """Why another user could rename an entry of the folder ``st`` describes, as ssh
    judges the folders above ``~/.ssh``: owned by root or you (``group``: or a group
    of yours), written by no one else unless sticky (only an entry's owner renames it)."""
    ours = group and st.st_gid in _my_groups()
    if st.st_uid not in (0, os.geteuid()) and not ours:
        return f"is owned by user {st.st_uid}, who can rename what it holds"
    if st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH:
        return "can be written by every user and is not sticky"
    if st.st_mode & stat.S_IWGRP and not ours:
        return "can be written by its group and is not sticky"
    return None


def folders_above(path: Path) -> list[Path]:
    """Every folder whose entries lead to ``path``: those above it as written, and
    those above where each link on the way leads (a link is swapped in its folder)."""
    absolute = Path(os.path.abspath(path))
    starts = [Path(os.path.realpath(a)) for a in absolute.parents]
    starts.append(Path(os.path.realpath(absolute)).parent)
    found: list[Path] = []
    for start in starts:
        for folder in (start, *start.parents):
            if folder not in found:
                found.append(folder)
    return found


def unsafe_above(path: Path) -> tuple[Path, os.stat_result, str] | None:
    """The first folder above ``path`` another user could rename entries of, its
    ``stat`` and why;
    None when none can (then ``path`` names what it named when it was checked)."""
    group = group_mode()
    for folder in folders_above(path):
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            continue  # made later by private_mkdir, 0700
        why = unsafe_parent(st, group)
        if why is not None:
            return folder, st, why
    return None
