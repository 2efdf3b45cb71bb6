"""A snapshot's blob files on the host path: opened and checked against the
index, and their tensors read straight into host buffers (``engine/loading``
plans the read and picks this path or the CUDA staging one).

Every blob's header is checked against the checksum the index holds and every
tensor piece against its own checksum, while it is read into its buffer.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import CorruptBlobError
from ..format.container import Entry, Header, checksum, header_bytes, parse_header
from ..format.manifest import blob_manifest
from ..format.tensors import Piece as TensorPiece
from ..format.tensors import read_pieces
from ..records import Progress

if TYPE_CHECKING:
    from ..storage.blobs import BlobStore

__all__ = [
    "Blob",
    "open_known",
    "filled_by",
    "entry",
    "Ahead",
    "read_all",
    "Buffers",
    "Piece",
    "WORKERS",
]

AHEAD = 8  # blobs asked of the disk at once: a deep queue, bounded page-cache use
WORKERS = 4  # blobs read at once: the threads mostly wait on the disk (GIL released)


class Blob:
    """An open blob file, its checked header and its tensors' checksums."""

    def __init__(self, f: BinaryIO, header: Header, sums: dict[str, bytes], where: str) -> None:
        self.f, self.header, self.sums, self.where = f, header, sums, where


def open_known(blobs: BlobStore, file: str, known: tuple[int, bytes] | None) -> Blob:
    """Open a blob and verify its header against ``known`` (size, digest) from the index."""
    where = f"blob {file}"
    if known is None:
        raise CorruptBlobError(where, "the index no longer lists this blob")
    try:
        f = blobs.open(file)
    except FileNotFoundError:
        raise CorruptBlobError(where, "blob file is missing") from None
    try:
        size = os.fstat(f.fileno()).st_size
        head = header_bytes(f, where, size)
        checked = _seen(known) if (size, checksum(head)) == known else None
        if checked is None:
            header = parse_header(head, size, where)
            if header.file_size != known[0] or header.digest != known[1]:
                raise CorruptBlobError(where, "blob header or size does not match the index")
            checked = header, blob_manifest(header, where)
            _remember(known, checked)
        return Blob(f, checked[0], checked[1], where)
    except BaseException:
        f.close()
        raise


# Headers already parsed and validated, by (file size, digest of the header
# bytes): a blob is immutable and its header bytes hash to the digest, so the
# same bytes parse the same.  Parsing 64 entries costs about 0.5 ms of Python
# a blob, all of it under the GIL the other readers wait for.
SEEN_HEADERS = 512
_checked: OrderedDict[tuple[int, bytes], tuple[Header, dict[str, bytes]]] = OrderedDict()
_checked_lock = threading.Lock()


def _seen(known: tuple[int, bytes]) -> tuple[Header, dict[str, bytes]] | None:
    """The parse of a header whose size and digest are ``known``, if one was kept."""
    with _checked_lock:
        hit = _checked.get(known)
        if hit is not None:
            _checked.move_to_end(known)
        return hit


def _remember(known: tuple[int, bytes], checked: tuple[Header, dict[str, bytes]]) -> None:
    with _checked_lock:
        _checked[known] = checked
        while len(_checked) > SEEN_HEADERS:
            _checked.popitem(last=False)


Buffers = dict[str, tuple[Any, memoryview, int]]  # tensor key -> (array, writable view, axis)
Piece = tuple[str, int, str]  # blob file, first position it holds, which tensors to take


def filled_by(
    keys: Iterable[str], split: dict[str, int], which: str, at: int
) -> list[tuple[str, int]]:
    """The tensors a piece of ``which`` part gives, each with the first position it
    fills: block i fills positions [i*B, (i+1)*B) of every split tensor ("split",
    "all"), the tail the rest and every other tensor ("rest", "all")."""
    return [
        (key, at if key in split else 0)
        for key in keys
        if (which != "rest" if key in split else which != "split")
    ]


def entry(blob: Blob, key: str) -> tuple[Entry, str]:
    """Tensor ``key``'s header entry in ``blob``, and its name for errors."""
    found = blob.header.tensors.get(key)
    if found is None:
        raise CorruptBlobError(blob.where, f"tensor {key!r} is missing")
    return found, f"{blob.where}: tensor {key!r}"


class Ahead:
    """Announces blobs to the kernel a window ahead of the reads (on the pool's
    threads), so the disk always has the next AHEAD blobs to read and the page
    cache never holds more than two windows."""

    def __init__(self, pool: ThreadPoolExecutor, blobs: BlobStore, files: list[str]) -> None:
        self.pool, self.files = pool, files
        self.prefetch = getattr(blobs, "prefetch", None)

    def window(self, n: int) -> None:
        if self.prefetch is not None and n % AHEAD == 0:
            for file in self.files[n : n + AHEAD]:
                self.pool.submit(self.prefetch, file)


def read_all(
    pool: ThreadPoolExecutor,
    ahead: Ahead,
    blobs: BlobStore,
    *,
    pieces: list[Piece],
    heads: dict[str, tuple[int, bytes] | None],
    buffers: Buffers,
    split: dict[str, int],
    progress: Progress | None,
) -> None:
    """Read every piece into its buffers, WORKERS blobs at a time.

    preadv and xxhash release the GIL, so the copies out of the page cache
    and the checksums run on every core while the disk reads ahead.  Pieces
    write disjoint positions of the buffers.  The first error stops new
    reads; the reads already running finish before it is raised.
    """
    done = 0

    def settle(finished: set[Future[None]]) -> None:
        nonlocal done
        for fut in finished:
            fut.result()
            done += 1
            if progress is not None:
                progress(done, len(pieces))

    pending: set[Future[None]] = set()
    try:
        for n, (file, at, which) in enumerate(pieces):
            ahead.window(n + AHEAD)
            read = functools.partial(
                _read_blob,
                blobs,
                file,
                heads[file],
                at=at,
                which=which,
                buffers=buffers,
                split=split,
            )
            pending.add(pool.submit(read))
            if len(pending) >= 2 * WORKERS:  # a bounded queue: few open files
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                settle(finished)
        finished, pending = wait(pending)
        settle(finished)
    except BaseException:
        for fut in pending:
            fut.cancel()
        raise


def _read_blob(
    blobs: BlobStore,
    file: str,
    known: tuple[int, bytes] | None,
    *,
    at: int,
    which: str,
    buffers: Buffers,
    split: dict[str, int],
) -> None:
    # block i fills positions [i*B, (i+1)*B) of every split tensor, the tail
    # the rest and every other tensor
    blob = open_known(blobs, file, known)
    try:
        wanted = [
            _piece(blob, key, *buffers[key], pos)
            for key, pos in filled_by(buffers, split, which, at)
        ]
        read_pieces(blob.f.fileno(), wanted)
    finally:
        with contextlib.suppress(OSError):
            blob.f.close()


def _piece(blob: Blob, key: str, out: Any, view: memoryview, axis: int, at: int) -> TensorPiece:
    e, where = entry(blob, key)
    return TensorPiece(
        start=e.start,
        stored=e.spec,
        into=view,
        alloc_shape=tuple(out.shape),
        at=at,
        axis=axis,
        want=blob.sums[key],
        where=where,
    )
