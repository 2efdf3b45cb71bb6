"""The one write path of every persist file: a sequential, fsynced sink.

``atomic_write`` streams into a ``Sink`` (O_DIRECT through reused, aligned
staging buffers where the filesystem allows it), fsyncs, renames and fsyncs
the folder.  It knows nothing of the bytes' format (``format.container``
writes safetensors into it).  Pure Python, no mlx.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "Sink", "atomic_write", "fsync_dir", "place", "tmp_beside", "ALIGN", "DIRECT_MIN_BYTES",
    "STAGE_BYTES",
]  # fmt: skip

T = TypeVar("T")

ALIGN = 8  # where data starts in a file written through the page cache
DIRECT_ALIGN = 4096
DIRECT_MIN_BYTES = 4 << 20
STAGE_BYTES = 8 << 20


class Sink:
    """A new file written sequentially, then fsynced.

    Where the filesystem allows it the file is opened with O_DIRECT and fed
    through an aligned staging buffer: writes then skip the page cache, which
    on some machines (VMs with cold memory) is several times faster than
    filling fresh cache pages, and a save does not evict the caller's data.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        mode: int = 0o600,
        size_hint: int = 0,
        cached: bool = False,
    ) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        # Small files go through the page cache: no 4 KiB header alignment for them.
        # ``cached``: all of it does, for a reader that comes soon (persist serve's
        # restores after a restart read what it wrote: warm, not from the disk).
        big = size_hint >= DIRECT_MIN_BYTES and not cached
        direct = getattr(os, "O_DIRECT", 0) if big else 0
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | direct, mode)
                self.direct = True
            except OSError:
                fd = -1
        if fd < 0:
            fd = os.open(path, flags, mode)
        self.fd = fd
        self.size = 0
        self.head_digest = b""  # set by write_tensors: checksum of the final header
        self._stage = _take_stage() if self.direct else None
        self._fill = 0

    @property
    def align(self) -> int:
        return DIRECT_ALIGN if self.direct else ALIGN

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        if self._stage is None:
            _write_all(self.fd, view)
            return
        stage = memoryview(self._stage)
        while view.nbytes:
            n = min(view.nbytes, STAGE_BYTES - self._fill)
            stage[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == STAGE_BYTES:
                _write_all(self.fd, stage)
                self._fill = 0

    def rewrite_head(self, head: bytes) -> None:
        """Overwrite the first ``len(head)`` bytes (a multiple of ``align``)."""
        if self._stage is None:
            os.pwrite(self.fd, head, 0)
            return
        buf = mmap.mmap(-1, len(head))  # page-aligned, as O_DIRECT requires
        try:
            buf.write(head)
            if os.pwrite(self.fd, memoryview(buf), 0) != len(head):
                raise OSError("short write of the header")
        finally:
            buf.close()

    def flush(self) -> None:
        """Write what is staged and trim the alignment padding (no fsync yet)."""
        if self._stage is not None and self._fill:
            padded = -(-self._fill // DIRECT_ALIGN) * DIRECT_ALIGN
            self._stage[self._fill : padded] = bytes(padded - self._fill)
            _write_all(self.fd, memoryview(self._stage)[:padded])
            self._fill = 0
            os.ftruncate(self.fd, self.size)

    def finish(self) -> None:
        """Write what is staged, then fsync: nothing is written to the file after this."""
        self.flush()
        os.fsync(self.fd)

    def close(self) -> None:
        if self._stage is not None:
            _give_stage(self._stage)
            self._stage = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Staging buffers outlive the writer threads (new every save): fresh pages are slow
# on VMs (~1 s/GiB on a 2-core one), so the next save reuses these.
KEEP_STAGES = 2  # a save writes two blobs at once (engine/blob_writes.WRITERS)
_free_stages: list[mmap.mmap] = []
_stages_lock = threading.Lock()


def _take_stage() -> mmap.mmap:
    with _stages_lock:
        return _free_stages.pop() if _free_stages else mmap.mmap(-1, STAGE_BYTES)


def _give_stage(stage: mmap.mmap) -> None:
    with _stages_lock:
        if len(_free_stages) < KEEP_STAGES:
            _free_stages.append(stage)
            return
    # A failed write's traceback may still hold a view of the buffer;
    # then the garbage collector unmaps it later.
    with contextlib.suppress(BufferError):
        stage.close()


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_beside(path: str | os.PathLike[str], suffix: str = ".tmp") -> str:
    """A fresh temporary name in ``path``'s folder, ``.NAME.PID.RANDOM{suffix}``; for a
    name too long to carry (255 bytes a name: ENAMETOOLONG, attack 38d, finding G)
    ``.persist.PID.RANDOM{suffix}``."""
    folder, name = os.path.split(os.fspath(path))
    tail = f".{os.getpid()}.{secrets.token_hex(6)}{suffix}"
    if len(os.fsencode(f".{name}{tail}")) > 255:
        name = "persist"
    return os.path.join(folder, f".{name}{tail}")


def atomic_write(
    tmp: str | os.PathLike[str],
    final: str | os.PathLike[str],
    write: Callable[[Sink], T],
    size_hint: int = 0,
    mode: int = 0o600,
    cached: bool = False,
    replace: bool = True,
) -> tuple[int, T]:
    """The one write path of every persist file: tmp, stream, fsync, rename, fsync the folder.

    ``write`` streams into the sink and finishes (fsyncs) it.  Returns the
    file's size and what ``write`` returned; on any failure the tmp file goes.
    ``cached``: through the page cache, never O_DIRECT (``Sink``).  ``replace``
    False: ``final`` is made only where nothing is (``place``).
    """
    sink = Sink(tmp, mode, size_hint, cached)
    try:
        result = write(sink)
        size = sink.size
        sink.close()
        place(tmp, final, replace)
        fsync_dir(os.path.dirname(os.fspath(final)) or ".")
    except BaseException:
        sink.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return size, result


# link(2) refused by a file system without hard links (FAT, some FUSE and network mounts)
NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS}


def place(tmp: str | os.PathLike[str], final: str | os.PathLike[str], replace: bool) -> None:
    """Give the finished file ``tmp`` its name ``final``: a rename over whatever is
    there, or (``replace`` False) a link, which fails (FileExistsError) where anything
    is, even a file made after the caller last looked; the rename never could."""
    if replace:
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final, follow_symlinks=False)
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
        # no hard links here: claim the name (O_EXCL), then rename over the claim
        os.close(os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.replace(tmp, final)
        return
    os.unlink(tmp)
