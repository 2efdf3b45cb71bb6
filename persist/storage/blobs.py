"""Blob files behind a small interface, so a shared backend can replace them.

Layout::

    <root>/blobs/ab/<key>.<salt>.safetensors   immutable once renamed into place
    <root>/tmp/<salt>.<random>.tmp             partial writes; garbage once their lease is free
    <root>/tmp/<salt>.lease                    held (flock) by the save of that salt (leases.py)

``key`` is the blob's namespace-salted content key; ``salt`` makes every
written file name unique, so a concurrent garbage collection that deletes an
unreferenced file can never delete another writer's fresh copy of the same
content.  Write protocol: tmp file, fsync, rename, fsync the directory.
No mlx here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from ..errors import CorruptBlobError
from ..format.opening import open_regular
from ..format.sink import Sink, atomic_write, fsync_dir
from . import leases
from .access import check_part

__all__ = ["BlobStore", "FileBlobs", "FILE_RE"]

T = TypeVar("T")
FILE_RE = re.compile(r"[0-9a-f]{32}\.[0-9a-f]{12}")
DIR_MODE = 0o700
FILE_MODE = 0o600
PREFETCH_BYTES = 1 << 20  # per WILLNEED (one call reads ahead at most the device's readahead)


class BlobStore(Protocol):
    def lease(self) -> leases.Lease: ...

    def put(
        self, key: str, write: Callable[[Sink], T], size_hint: int = 0, salt: str | None = None
    ) -> tuple[str, int, T]: ...

    def open(self, file: str) -> BinaryIO: ...

    def file_name(self, key: str, salt: str) -> str: ...

    def exists(self, file: str) -> bool: ...

    def delete(self, file: str) -> None: ...

    def files(self) -> Iterator[str]: ...


class FileBlobs:
    """Blobs as files under ``root``; nothing inside the store is followed through a link.

    The store root itself may be a link (a store on another disk); ``blobs/``,
    ``tmp/``, the ``blobs/ab/`` directories and the files in them must be
    real.  A link there (planted by anyone who can write the store root) is
    never opened, written through or deleted through: check reports it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        # written through the page cache (a server that restores what it saved),
        # else large blobs skip it (format.sink: O_DIRECT)
        self.cached_writes = False
        self.blobs = root / "blobs"
        self.tmp = root / "tmp"
        for d in (self.blobs, self.tmp):
            try:
                d.mkdir(mode=DIR_MODE)  # a link stays a link: writes refuse it, check reports it
            except FileExistsError:
                pass
            except OSError as e:  # a read-only store: its writes are refused before they start
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise

    def path(self, file: str) -> Path:
        if not FILE_RE.fullmatch(file):
            raise ValueError(f"not a blob file name: {file!r}")
        return self.blobs / file[:2] / f"{file}.safetensors"

    def lease(self) -> leases.Lease:
        """A new save's salt, its lease held (``check`` leaves the save alone while it is)."""
        _require_real_dir(self.tmp)
        return leases.take(self.tmp)

    def put(
        self, key: str, write: Callable[[Sink], T], size_hint: int = 0, salt: str | None = None
    ) -> tuple[str, int, T]:
        """Write a new blob; ``write`` streams into the sink and finishes (fsyncs) it.

        ``salt`` (12 hex digits) ends the file name: a save registers it as
        pending, so ``check`` does not take its uncommitted files for orphans.
        """
        file = self.file_name(key, salt or secrets.token_hex(6))
        final = self.path(file)
        _require_real_dir(self.tmp)
        _require_real_dir(self.blobs)
        try:
            final.parent.mkdir(mode=DIR_MODE)
            fsync_dir(self.blobs)
        except FileExistsError:
            pass
        _require_real_dir(final.parent)
        check_part(final.parent, os.lstat(final.parent))  # another user's: refused
        # named by the save's salt: check leaves it while that save's lease is held
        tmp = self.tmp / f"{file[-12:]}.{secrets.token_hex(8)}.tmp"
        size, result = atomic_write(tmp, final, write, size_hint, FILE_MODE, self.cached_writes)
        return file, size, result

    @staticmethod
    def file_name(key: str, salt: str) -> str:
        """A blob's file name: its content key and the salt of the save that wrote it."""
        return f"{key}.{salt}"

    def open(self, file: str) -> BinaryIO:
        path = self.path(file)
        _require_real_dir(path.parent, missing_ok=True)
        f = open_regular(path)  # no link, no FIFO: a FIFO here hung every reader
        try:  # a folder or file another user can change: refused, as the store root is
            check_part(path.parent, os.lstat(path.parent))
            check_part(path, os.fstat(f.fileno()))
        except BaseException:
            f.close()
            raise
        return f

    def prefetch(self, file: str) -> None:
        """Ask the kernel to start reading ``file`` now (a restore reads it next).

        One WILLNEED reads ahead at most the device's readahead size (8 MiB on
        this project's VM), so a blob is announced in PREFETCH_BYTES steps.
        """
        with contextlib.suppress(OSError, ValueError), open_regular(self.path(file)) as f:
            fd = f.fileno()
            for at in range(0, os.fstat(fd).st_size, PREFETCH_BYTES):
                os.posix_fadvise(fd, at, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)

    def cached(self, file: str) -> float | None:
        """The share of ``file``'s pages in the page cache (mincore on a private
        mapping: looking loads nothing, where a RWF_NOWAIT read starts readahead).
        None where it cannot be told (no such file, an empty one, no mincore)."""
        try:
            with open_regular(self.path(file)) as f:
                return resident_share(f.fileno())
        except (OSError, ValueError):
            return None

    def exists(self, file: str) -> bool:
        try:
            return self.path(file).is_file()
        except ValueError:
            return False

    def delete(self, file: str) -> None:
        path = self.path(file)
        if _is_link(path.parent) or _is_link(path):
            return  # never through or of a link: check reports it
        # gone already, its folder a file now, or a folder in its place: check reports it
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            os.unlink(path)

    def files(self) -> Iterator[str]:
        """Every well-formed blob file name on disk (regular files in real directories)."""
        for sub, entries in self._subdirs():
            for e in entries:
                name = e.name.removesuffix(".safetensors")
                if (
                    e.name != name
                    and FILE_RE.fullmatch(name)
                    and name[:2] == sub
                    and e.is_file(follow_symlinks=False)
                ):
                    yield name

    def stray_files(self) -> Iterator[Path]:
        """Anything under blobs/ that is not a well-formed blob file (links included)."""
        for e in _entries(self.blobs):
            if not e.is_dir(follow_symlinks=False):
                yield Path(e.path)
        for sub, entries in self._subdirs():
            for e in entries:
                name = e.name.removesuffix(".safetensors")
                if (
                    e.name == name
                    or not FILE_RE.fullmatch(name)
                    or name[:2] != sub
                    or not e.is_file(follow_symlinks=False)
                ):
                    yield Path(e.path)

    def parts(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Every ``blobs/ab/`` folder and every entry in one, not followed through a link;
        one a concurrent gc or rm removed meanwhile is left out (it is no one's now)."""
        for e in _entries(self.blobs):
            if e.is_dir(follow_symlinks=False):
                yield from _stat(e)
                for f in _entries(Path(e.path)):
                    if not f.is_symlink():  # a link: reported by check as one
                        yield from _stat(f)

    def tmp_files(self) -> Iterator[Path]:
        """Every entry of tmp/ (none if tmp/ is a link: it is not ours to list)."""
        if not _is_link(self.tmp):
            yield from sorted(Path(e.path) for e in _entries(self.tmp))

    def links(self) -> list[Path]:
        """Symbolic links where the store keeps real directories and files."""
        out = [d for d in (self.blobs, self.tmp) if _is_link(d)]
        out += [p for p in self.stray_files() if _is_link(p)]
        out += [p for p in self.tmp_files() if _is_link(p)]
        return out

    def _subdirs(self) -> Iterator[tuple[str, list[os.DirEntry[str]]]]:
        if _is_link(self.blobs):
            return
        for e in _entries(self.blobs):
            if e.is_dir(follow_symlinks=False):
                yield e.name, _entries(Path(e.path))


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _entries(d: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []  # a folder replaced by a file: check reports it (not-a-folder)


def _stat(e: os.DirEntry[str]) -> Iterator[tuple[Path, os.stat_result]]:
    try:
        yield Path(e.path), e.stat(follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return


def _is_link(p: Path) -> bool:
    return p.is_symlink()


def _require_real_dir(d: Path, missing_ok: bool = False) -> None:
    if _is_link(d):
        raise CorruptBlobError(str(d), "is a symbolic link; persist never follows links in a store")
    if not missing_ok and not d.is_dir():
        raise CorruptBlobError(str(d), "is not a directory")


_PAGE = mmap.PAGESIZE


def resident_share(fd: int) -> float | None:
    """The share of the pages of the file open at ``fd`` that are in the page cache."""
    size = os.fstat(fd).st_size
    mincore = _libc_mincore()
    if not size or mincore is None:
        return None
    with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)  # the mapping's address; maps nothing in
        try:
            pages = -(-size // _PAGE)
            vec = (ctypes.c_ubyte * pages)()
            if mincore(ctypes.addressof(anchor), ctypes.c_size_t(size), vec):
                return None
            return (pages - bytes(vec).count(0)) / pages
        finally:
            del anchor  # the mapping closes only once no buffer export is left


@functools.cache
def _libc_mincore() -> Any:
    """libc's mincore, looked up on first use (never at import: ``persist ls`` asks none)."""
    try:
        f = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):  # not Linux/BSD: no page cache to ask
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    f.restype = ctypes.c_int
    return f
