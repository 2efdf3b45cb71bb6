"""Read a stored snapshot (token blocks + tail) back into fresh caches.

Every blob's header is checked against the checksum the index holds and
every tensor piece against its own checksum, while it is read straight
into the final, capacity-sized buffer of its layer.  Nothing is handed out
unless the whole snapshot verified.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgpack

from .. import policy
from ..codecs import capacity_of, check_spec, trim_record
from ..codecs.snapshot import rebuild
from ..cuda import pinned
from ..cuda.kernels import as_tensor
from ..cuda.readers import ReaderLost
from ..errors import CorruptBlobError
from ..format.manifest import snapshot_specs
from ..format.tensors import (
    NAME_TO_MX,
    allocate_many,
    device_copy,
    dtype_name,
    grown_shape,
    on_cuda,
)
from ..records import DTYPE_SIZES, Progress, Record, RecordSpec, TensorSpec
from ..storage import rates
from . import partial as partial_room
from .blob_reads import WORKERS, Ahead, Blob, Buffers, Piece, entry, filled_by, open_known, read_all
from .staged import restore as staging

_log = logging.getLogger("persist")

if TYPE_CHECKING:
    from ..storage.blobs import BlobStore
    from ..storage.index import BlockRef, Index, SnapshotRow

__all__ = ["load_snapshot"]


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
    # The tail first: it holds every unsplit tensor (a hybrid's recurrent state,
    # a third of its bytes), read while the other workers take the blocks.
    pieces = [(row.tail, len(files) * block if split else 0, "rest" if partial else "all")]
    if partial and all(key in split for key in _keys(specs)):
        pieces = []  # every tensor is split: the blocks hold all a partial read needs
    pieces += [(f, i * block, "split") for i, f in enumerate(files[:need]) if split]
    heads = {file: index.blob_head(file) for file, _, _ in pieces}  # the index: this thread only
    room = partial_room.room_for(specs, split, keep, need * block) if keep and partial else {}
    length = need * block if partial else None
    choice = pinned.data_path()
    _note_path(index, choice)
    arrays = None
    # what either path reads, and into what shapes
    reads: dict[str, Any] = dict(
        heads=heads, specs=specs, split=split, length=length, room=room, progress=progress
    )
    if choice.ring is not None and not staging.busy():
        try:
            arrays = _staged(choice.ring, blobs, pieces, **reads)
        except ReaderLost as e:  # the next restore starts a new reader process
            _log.warning("persist: %s; this restore reads on the host path", e)
    if arrays is None:
        arrays = _host(blobs, pieces, **reads)
    records = [_record(spec, str(i), arrays) for i, spec in enumerate(specs)]
    if keep is not None and keep != row.n_tokens:
        trimmed = [trim_record(r, keep) for r in records]
        records = [
            partial_room.keep_buffers(t, r, str(i), room)
            for i, (t, r) in enumerate(zip(trimmed, records, strict=True))
        ]
    return rebuild(records)


_noted: weakref.WeakKeyDictionary[Any, pinned.Choice] = weakref.WeakKeyDictionary()


def _note_path(index: Index, choice: pinned.Choice) -> None:
    """Tell ``persist stats`` which path this process restores by (once per store)."""
    if _noted.get(index) is not choice:
        _noted[index] = choice
        rates.note_path(index, rates.machine_name(pinned.backend()), choice.describe())


def _host(
    blobs: BlobStore,
    pieces: list[Piece],
    *,
    heads: dict[str, tuple[int, bytes] | None],
    specs: list[RecordSpec],
    split: dict[str, int],
    length: int | None,
    room: partial_room.Room,
    progress: Progress | None,
) -> dict[str, Any]:
    """Today's path (CPU, Metal, CUDA without the ring): read into MLX buffers."""
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="persist-read") as pool:
        ahead = Ahead(pool, blobs, [f for f, _, _ in pieces])
        ahead.window(0)  # the disk starts while the buffers are allocated
        buffers = _allocate(specs, split, length, room)
        read_all(
            pool,
            ahead,
            blobs,
            pieces=pieces,
            heads=heads,
            buffers=buffers,
            split=split,
            progress=progress,
        )
    for key, (n, _) in room.items():
        out, view, axis = buffers[key]
        partial_room.zero_past(view, tuple(out.shape), dtype_name(out), axis, n)
    # on CUDA the host wrote these buffers: the caches get device copies of them
    settle = device_copy if on_cuda() else (lambda a: a)
    return {key: settle(out) for key, (out, _, _) in buffers.items()}


def _staged(
    ring: pinned.Ring,
    blobs: BlobStore,
    pieces: list[Piece],
    *,
    heads: dict[str, tuple[int, bytes] | None],
    specs: list[RecordSpec],
    split: dict[str, int],
    length: int | None,
    room: partial_room.Room,
    progress: Progress | None,
) -> dict[str, Any]:
    """CUDA: every tensor's device buffer first, then the blobs through the pinned
    lanes straight into them (engine/staged/restore)."""
    keys, wanted = _wanted(specs, split, length, room)
    shapes = {
        key: (grown_shape(spec, cap, axis), axis, spec.dtype)
        for key, (spec, cap, axis) in zip(keys, wanted, strict=True)
    }
    sizes = [math.prod(shape) * DTYPE_SIZES[dtype] for shape, _, dtype in shapes.values()]
    made = ring.buffers(sizes)
    dests = {
        key: staging.Dest(addr, shape, axis, room[key][0] if key in room else None, DTYPE_SIZES[d])
        for (key, (shape, axis, d)), (_, addr) in zip(shapes.items(), made, strict=True)
    }
    jobs = [
        staging.Job(
            functools.partial(
                _open_staged, blobs, f, heads[f], at=at, which=which, dests=dests, split=split
            )
        )
        for f, at, which in pieces
    ]
    each = [known[0] if (known := heads[f]) is not None else 0 for f, _, _ in pieces]
    staging.stage(ring, jobs, dests, sum(each), progress, sizes=each)
    return {
        key: as_tensor(flat, shape, NAME_TO_MX[dtype], n)
        for (key, (shape, _, dtype)), (flat, _), n in zip(shapes.items(), made, sizes, strict=True)
    }


def _open_staged(
    blobs: BlobStore,
    file: str,
    known: tuple[int, bytes] | None,
    *,
    at: int,
    which: str,
    dests: dict[str, staging.Dest],
    split: dict[str, int],
) -> tuple[int, list[staging.Want], Callable[[], None]]:
    """On a reader thread: open and check a blob, name the tensors it gives (as
    the host path does: ``blob_reads.filled_by``)."""
    blob = open_known(blobs, file, known)
    wants = [_want(blob, key, pos) for key, pos in filled_by(dests, split, which, at)]
    return blob.f.fileno(), wants, blob.f.close


def _want(blob: Blob, key: str, at: int) -> staging.Want:
    e, where = entry(blob, key)
    return staging.Want(
        key=key, start=e.start, end=e.end, stored=e.spec, at=at, want=blob.sums[key], where=where
    )


def _wanted(
    specs: list[RecordSpec], split: dict[str, int], length: int | None, room: partial_room.Room
) -> tuple[list[str], list[tuple[TensorSpec, int | None, int]]]:
    """Every tensor's key and (shape, capacity, axis); with ``length``, split tensors
    get exactly that many positions (a partial read, trimmed next) instead of their
    whole, capacity-sized shape, or the ``room`` their trimmed records want."""
    keys: list[str] = []
    wanted: list[tuple[TensorSpec, int | None, int]] = []

    def walk(spec: RecordSpec, path: str) -> None:
        caps = {} if length is not None else capacity_of(spec)
        for name, whole in spec.tensors.items():
            key = f"{path}/{name}"
            axis = split.get(key, 2)
            if length is not None and key in split:
                shape = list(whole.shape)
                shape[axis] = room[key][1] if key in room else length
                whole = TensorSpec(whole.dtype, tuple(shape))
            keys.append(key)
            wanted.append((whole, caps.get(name), axis))
        for j, c in enumerate(spec.children):
            walk(c, f"{path}.{j}")

    for i, spec in enumerate(specs):
        walk(spec, str(i))
    return keys, wanted


def _allocate(
    specs: list[RecordSpec], split: dict[str, int], length: int | None, room: partial_room.Room
) -> Buffers:
    """Host buffers for every tensor (``_wanted``'s shapes)."""
    keys, wanted = _wanted(specs, split, length, room)
    made = allocate_many(wanted)
    return {key: (arr, view, w[2]) for key, (arr, view), w in zip(keys, made, wanted, strict=True)}


def _keys(specs: list[RecordSpec]) -> list[str]:
    """Every tensor key (``layer/name``, children ``layer.j/name``), named as ``_allocate`` does."""
    out: list[str] = []

    def walk(spec: RecordSpec, path: str) -> None:
        out.extend(f"{path}/{name}" for name in spec.tensors)
        for j, c in enumerate(spec.children):
            walk(c, f"{path}.{j}")

    for i, spec in enumerate(specs):
        walk(spec, str(i))
    return out


def _record(spec: RecordSpec, path: str, arrays: dict[str, Any]) -> Record:
    tensors = {name: arrays[f"{path}/{name}"] for name in spec.tensors}
    kids = tuple(_record(c, f"{path}.{j}", arrays) for j, c in enumerate(spec.children))
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)
