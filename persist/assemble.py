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

from .blocks import spec_from_manifest
from .codecs import check_spec, trim_record
from .errors import CorruptBlobError
from .reader import allocate, capacity_of, read_piece
from .records import Progress, Record, RecordSpec
from .snapshot import rebuild
from .stfile import Header, read_header
from .store.blobs import blob_manifest

if TYPE_CHECKING:
    from .sessions import Store
    from .store.index import SnapshotRow

__all__ = ["load_snapshot", "open_blob"]


class _Blob:
    def __init__(self, f: BinaryIO, header: Header, sums: dict[str, bytes], where: str) -> None:
        self.f, self.header, self.sums, self.where = f, header, sums, where


def open_blob(store: Store, file: str) -> _Blob:
    """Open a blob and verify its header against the index."""
    where = f"blob {file}"
    known = store.index.blob_head(file)
    if known is None:
        raise CorruptBlobError(where, "the index no longer lists this blob")
    try:
        f = store.blobs.open(file)
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
    store: Store, row: SnapshotRow, progress: Progress | None = None, keep: int | None = None
) -> list[Any]:
    """Fresh caches of ``row``; with ``keep``, exactly as a prefill of that many tokens."""
    refs = store.index.verified_blocks(row)  # a damaged row is refused before anything else
    body = msgpack.unpackb(row.manifest, raw=False)
    specs = spec_from_manifest(body)
    for spec in specs:
        check_spec(spec)
    split: dict[str, int] = body["split"]
    block: int = body["block"]
    opened: dict[str, _Blob] = {}
    try:
        tail = opened.setdefault(row.tail, open_blob(store, row.tail))
        blocks = []
        for ref in refs:
            if ref.blob is None:
                continue
            if ref.blob not in opened:
                opened[ref.blob] = open_blob(store, ref.blob)
            blocks.append(opened[ref.blob])
        if split and len(blocks) != row.n_blocks:
            raise CorruptBlobError(f"snapshot {row.id}", "block list is incomplete")
        records = []
        for i, spec in enumerate(specs):
            records.append(_read(spec, str(i), tail, blocks, split, block))
            if progress is not None:
                progress(i + 1, len(specs))
        if keep is not None and keep != row.n_tokens:
            records = [trim_record(r, keep) for r in records]
        return rebuild(records)
    finally:
        for b in opened.values():
            with contextlib.suppress(OSError):
                b.f.close()


def _read(
    spec: RecordSpec,
    path: str,
    tail: _Blob,
    blocks: list[_Blob],
    split: dict[str, int],
    block: int,
) -> Record:
    caps = capacity_of(spec)
    tensors = {}
    for key, name in ((f"{path}/{n}", n) for n in spec.tensors):
        whole = spec.tensors[name]
        axis = split.get(key, 2)
        out, view = allocate(whole, caps.get(name), axis)
        pieces = [(b, i * block) for i, b in enumerate(blocks)] if key in split else []
        pieces.append((tail, len(pieces) * block if key in split else 0))
        for blob, at in pieces:
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
        tensors[name] = out
    kids = tuple(
        _read(c, f"{path}.{j}", tail, blocks, split, block) for j, c in enumerate(spec.children)
    )
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)
