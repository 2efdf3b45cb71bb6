"""Read validated tensors straight into the buffers the caches will use.

Each tensor is read (``preadv``) into a fresh MLX array whose token axis
already has the capacity its codec asks for, and its checksum is computed
over exactly the bytes read.  No intermediate copy: peak memory is the
restored cache itself, and the first decode step after a restore does not
reallocate.  A tensor stored in pieces (the store's token blocks) is read
piece by piece into the same buffer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import xxhash

from .codecs.base import NAME_TO_MX
from .errors import CorruptBlobError
from .kinds import class_for, codec_for
from .manifest import Manifest
from .records import DTYPE_SIZES, Record, RecordSpec, TensorSpec

__all__ = ["read_layer", "capacity_of", "allocate", "read_piece"]


def capacity_of(spec: RecordSpec) -> dict[str, int]:
    """Token-axis room per tensor, from the codec's optional ``capacity`` hook."""
    hook = getattr(codec_for(spec.kind), "capacity", None)
    return dict(hook(spec, class_for(spec.kind))) if hook is not None else {}


def allocate(spec: TensorSpec, cap: int | None, axis: int = 2) -> tuple[mx.array, memoryview]:
    """A zeroed MLX array for ``spec`` (token axis grown to ``cap``) and a writable view."""
    shape = list(spec.shape)
    if cap is not None and len(shape) > axis and cap > shape[axis]:
        shape[axis] = cap
    out = mx.zeros(shape, dtype=NAME_TO_MX[spec.dtype])
    mx.eval(out)
    if out.size == 0:
        return out, memoryview(bytearray())
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    if not view.contiguous or view.nbytes != math.prod(shape) * DTYPE_SIZES[spec.dtype]:
        raise RuntimeError("mlx returned a buffer persist cannot read into")
    return out, view


def read_piece(
    fd: int,
    start: int,
    stored: TensorSpec,
    into: memoryview,
    alloc_shape: tuple[int, ...],
    at: int,
    axis: int,
    want: bytes,
    where: str,
) -> None:
    """Read a stored tensor into ``into`` at position ``at`` of ``axis``; verify it."""
    h = xxhash.xxh3_128()
    pos = start
    for chunk in _regions(into, stored.shape, alloc_shape, at, axis, DTYPE_SIZES[stored.dtype]):
        got = os.preadv(fd, [chunk], pos)
        if got != chunk.nbytes:
            raise CorruptBlobError(where, "file truncated inside a tensor")
        h.update(chunk)
        pos += got
    if h.digest() != want:
        raise CorruptBlobError(where, "checksum mismatch in tensor data")


def _regions(
    view: memoryview,
    stored: tuple[int, ...],
    alloc: tuple[int, ...],
    at: int,
    axis: int,
    item: int,
) -> Iterator[memoryview]:
    """The regions of ``view`` that receive the stored tensor, in file order."""
    if tuple(stored) == tuple(alloc) and at == 0:
        if view.nbytes:
            yield view
        return
    inner = math.prod(stored[axis + 1 :]) * item
    size = stored[axis] * inner
    stride = alloc[axis] * inner
    if not size:
        return
    for r in range(math.prod(stored[:axis])):
        base = r * stride + at * inner
        yield view[base : base + size]


def read_layer(fd: int, spec: RecordSpec, keys: Any, manifest: Manifest, where: str) -> Record:
    """Read one record of a persist file (and its inner records), verified."""
    mapping = next(keys)
    caps = capacity_of(spec)
    tensors = {}
    for name, key in mapping.items():
        stored = manifest.specs[key]
        out, view = allocate(stored, caps.get(name))
        read_piece(
            fd,
            manifest.offsets[key],
            stored,
            view,
            tuple(out.shape),
            0,
            2,
            manifest.checksums[key],
            f"{where}: tensor {key!r}",
        )
        tensors[name] = out
    kids = tuple(read_layer(fd, c, keys, manifest, where) for c in spec.children)
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)
