"""Read a stored snapshot (token blocks + tail) back into fresh caches.

Every blob's header is checked against the checksum the index holds and
every tensor piece against its own checksum, while it is read straight
into the final, capacity-sized buffer of its layer.  Nothing is handed out
unless the whole snapshot verified.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, BinaryIO

import msgpack

from .. import policy
from ..codecs import capacity_of, check_spec, trim_record
from ..codecs.snapshot import rebuild
from ..errors import CorruptBlobError
from ..format.container import Header, read_header
from ..format.manifest import blob_manifest, snapshot_specs
from ..format.tensors import allocate, device_copy, on_cuda, read_piece
from ..records import Progress, Record, RecordSpec, TensorSpec

if TYPE_CHECKING:
    from ..store.blobs import BlobStore
    from ..store.index import BlockRef, Index, SnapshotRow

__all__ = ["load_snapshot", "open_blob"]

AHEAD = 8  # blobs asked of the disk at once: a deep queue, bounded page-cache use


class _Blob:
    def __init__(self, f: BinaryIO, header: Header, sums: dict[str, bytes], where: str) -> None:
        self.f, self.header, self.sums, self.where = f, header, sums, where


def open_blob(index: Index, blobs: BlobStore, file: str) -> _Blob:
    """Open a blob and verify its header against the index."""
    where = f"blob {file}"
    known = index.blob_head(file)
    if known is None:
        raise CorruptBlobError(where, "the index no longer lists this blob")
    try:
        f = blobs.open(file)
    except FileNotFoundError:
        raise CorruptBlobError(where, "blob file is missing") from None
    try:
        header = read_header(f, where)
        if header.file_size != known[0] or header.digest != known[1]:
            raise CorruptBlobError(where, "blob header or size does not match the index")
        return _Blob(f, header, blob_manifest(header, where), where)
    except BaseException:
        f.close()
        raise


def load_snapshot(
    index: Index,
    blobs: BlobStore,
    row: SnapshotRow,
    progress: Progress | None = None,
    keep: int | None = None,
    refs: list[BlockRef] | None = None,
) -> list[Any]:
    """Fresh caches of ``row``; with ``keep``, exactly as a prefill of that many tokens.

    ``refs`` are the row's blocks when the caller read them with the row (in
    one transaction, checksum verified); otherwise they are read and verified here.
    """
    if refs is None:
        refs = index.verified_blocks(row)  # a damaged row is refused first
    body = msgpack.unpackb(row.manifest, raw=False)
    specs = snapshot_specs(body)
    for spec in specs:
        check_spec(spec)
    split: dict[str, int] = body["split"]
    block: int = body["block"]
    files = [ref.blob for ref in refs if ref.blob is not None]
    if split and len(files) != row.n_blocks:
        raise CorruptBlobError(f"snapshot {row.id}", "block list is incomplete")
    # A hit of k tokens that ends within the full blocks reads only the blocks
    # covering [0, k) and the tail's other tensors: split tensors hold their
    # first need*B positions, which is all a trim to k looks at.
    blocks_read = policy.partial_blocks(keep, row.n_tokens, len(files), block, bool(split))
    partial = blocks_read is not None
    need = len(files) if blocks_read is None else blocks_read
    buffers = _allocate(specs, split, need * block if partial else None)
    # One blob open at a time (a 70,000-token session has hundreds of blocks,
    # more than a default open-file limit): block i fills positions [i*B, (i+1)*B)
    # of every split tensor, the tail the rest and every other tensor.
    pieces = [(f, i * block, "split") for i, f in enumerate(files[:need]) if split]
    pieces.append((row.tail, len(files) * block if split else 0, "rest" if partial else "all"))
    prefetch = getattr(blobs, "prefetch", None)
    for done, (file, at, which) in enumerate(pieces):
        if prefetch is not None and done % AHEAD == 0:
            for ahead, _, _ in pieces[done : done + AHEAD]:
                prefetch(ahead)  # the disk reads these while earlier blobs are copied
        blob = open_blob(index, blobs, file)
        try:
            for key, (out, view, axis) in buffers.items():
                if key in split and which != "rest":
                    _fill(blob, key, out, view, at, axis)
                elif key not in split and which != "split":
                    _fill(blob, key, out, view, 0, axis)
        finally:
            with contextlib.suppress(OSError):
                blob.f.close()
        if progress is not None:
            progress(done + 1, len(pieces))
    records = [_record(spec, str(i), buffers) for i, spec in enumerate(specs)]
    if keep is not None and keep != row.n_tokens:
        records = [trim_record(r, keep) for r in records]
    return rebuild(records)


Buffers = dict[str, tuple[Any, memoryview, int]]  # tensor key -> (array, writable view, axis)


def _allocate(specs: list[RecordSpec], split: dict[str, int], length: int | None) -> Buffers:
    """Buffers for every tensor; with ``length``, split tensors get exactly that many
    positions (a partial read, trimmed next) instead of their whole, capacity-sized shape."""
    out: Buffers = {}

    def walk(spec: RecordSpec, path: str) -> None:
        caps = {} if length is not None else capacity_of(spec)
        for name, whole in spec.tensors.items():
            key = f"{path}/{name}"
            axis = split.get(key, 2)
            if length is not None and key in split:
                shape = list(whole.shape)
                shape[axis] = length
                whole = TensorSpec(whole.dtype, tuple(shape))
            arr, view = allocate(whole, caps.get(name), axis)
            out[key] = (arr, view, axis)
        for j, c in enumerate(spec.children):
            walk(c, f"{path}.{j}")

    for i, spec in enumerate(specs):
        walk(spec, str(i))
    return out


def _fill(blob: _Blob, key: str, out: Any, view: memoryview, at: int, axis: int) -> None:
    entry = blob.header.tensors.get(key)
    if entry is None:
        raise CorruptBlobError(blob.where, f"tensor {key!r} is missing")
    read_piece(
        blob.f.fileno(),
        entry.start,
        entry.spec,
        view,
        tuple(out.shape),
        at,
        axis,
        blob.sums[key],
        f"{blob.where}: tensor {key!r}",
    )


def _record(spec: RecordSpec, path: str, buffers: Buffers) -> Record:
    # on CUDA the host wrote these buffers: the caches get device copies of them
    settle = device_copy if on_cuda() else (lambda a: a)
    tensors = {name: settle(buffers[f"{path}/{name}"][0]) for name in spec.tensors}
    kids = tuple(_record(c, f"{path}.{j}", buffers) for j, c in enumerate(spec.children))
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)
