"""``check``'s look at ``tmp/``: partial writes and leases of saves that died.

A save holds a lease (``leases``) while its partial writes lie in ``tmp/``;
one whose lease is free, and that is still there once claimed, is a dead
save's.  An older persist named its partial writes by pid, without a lease:
those are kept while the pid lives and younger than the grace.  No mlx.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from pathlib import Path

from . import leases
from .blobs import FileBlobs
from .types import Problem

__all__ = ["tmp_problems", "TMP_GRACE_SECONDS", "LEGACY_TMP_RE"]

TMP_GRACE_SECONDS = 3600.0  # an older persist's tmp file (no lease) this old is debris
LEGACY_TMP_RE = re.compile(r"(\d+)-[0-9a-f]{16}\.tmp")


def tmp_problems(blobs: FileBlobs, fix: bool) -> list[Problem]:
    """Partial writes and leases of saves whose lease is free; only names persist
    writes, only regular files.  A held lease is a save in flight, whatever its pid,
    PID namespace or clock (``leases``)."""
    out = []
    for p in blobs.tmp_files():
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # renamed into place (or removed) while we looked
        if stat.S_ISLNK(st.st_mode):
            continue  # reported by _links
        salt = _tmp_salt(p.name)
        if salt is None or not stat.S_ISREG(st.st_mode):
            out.append(Problem("stray-file", str(p), "not a name persist writes; left", False))
            continue
        if salt == "" and _legacy_live(p.name, st.st_mtime):
            continue
        if salt:
            with leases.claim(blobs.tmp, salt, remove=False) as free:
                if not free or not _still_there(p, fix):
                    continue  # its save holds the lease, or it ended as we looked
        elif fix:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        what = "a dead save's lease" if p.name.endswith(".lease") else "partial write"
        out.append(Problem("orphan-tmp", str(p), f"{what}, its writer is gone", fix))
    return out


def _still_there(p: Path, fix: bool) -> bool:
    """A tmp/ entry whose lease is free is left by a dead save only if it is still
    there: a save that ended between the listing and the claim renamed its partial
    write into place and removed its lease (attack r15: reported as dead).  With
    ``fix`` it is removed, and was there if the removal found it."""
    if not fix:
        return os.path.lexists(p)
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    return True


def _tmp_salt(name: str) -> str | None:
    """The salt whose lease covers a tmp/ entry; "" for an older persist's ``<pid>-``
    name; None for a name persist does not write."""
    m = leases.LEASE_RE.fullmatch(name) or leases.SALT_TMP_RE.fullmatch(name)
    if m is not None:
        return m.group(1)
    return "" if LEGACY_TMP_RE.fullmatch(name) else None


def _legacy_live(name: str, mtime: float) -> bool:
    """An older persist's partial write (named by pid, no lease): kept while its pid
    lives and it is younger than the grace (the only sign such a writer gave)."""
    m = LEGACY_TMP_RE.fullmatch(name)
    assert m is not None
    return _alive(int(m.group(1))) and time.time() - mtime < TMP_GRACE_SECONDS


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
