"""Read a validated file's tensors straight into the buffers the caches will use.

Each tensor is read (``preadv``) into a fresh MLX array whose token axis
already has the capacity its codec asks for, and its checksum is computed
over exactly the bytes read.  No intermediate copy: peak memory is the
restored cache itself, and the first decode step after a restore does not
reallocate.
"""

from __future__ import annotations

import math
import os
from typing import Any

import mlx.core as mx
import xxhash

from .codecs.base import NAME_TO_MX
from .errors import CorruptBlobError
from .kinds import class_for, codec_for
from .manifest import Manifest
from .records import DTYPE_SIZES, Record, RecordSpec

__all__ = ["read_layer"]


def read_layer(fd: int, spec: RecordSpec, keys: Any, manifest: Manifest, where: str) -> Record:
    """Read one record (and its inner records) with verified checksums."""
    mapping = next(keys)
    capacity = _capacity(spec)
    tensors = {}
    for name, key in mapping.items():
        tensors[name] = _read_tensor(fd, key, capacity.get(name), manifest, where)
    kids = tuple(read_layer(fd, c, keys, manifest, where) for c in spec.children)
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)


def _capacity(spec: RecordSpec) -> dict[str, int]:
    # Optional codec hook: token-axis room to allocate per tensor.
    hook = getattr(codec_for(spec.kind), "capacity", None)
    return dict(hook(spec, class_for(spec.kind))) if hook is not None else {}


def _read_tensor(fd: int, key: str, cap: int | None, manifest: Manifest, where: str) -> mx.array:
    spec = manifest.specs[key]
    start = manifest.offsets[key]
    shape = list(spec.shape)
    n = shape[2] if len(shape) == 4 else None
    if cap is not None and n is not None and cap > n:
        shape[2] = cap
    out = mx.zeros(shape, dtype=NAME_TO_MX[spec.dtype])
    mx.eval(out)
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    if not view.contiguous or view.nbytes != math.prod(shape) * DTYPE_SIZES[spec.dtype]:
        raise RuntimeError("mlx returned a buffer persist cannot read into")
    h = xxhash.xxh3_128()
    pos = start
    for chunk in _chunks(view, spec.shape, shape, DTYPE_SIZES[spec.dtype]):
        got = os.preadv(fd, [chunk], pos)
        if got != chunk.nbytes:
            raise CorruptBlobError(where, f"file truncated inside tensor {key!r}")
        h.update(chunk)
        pos += got
    if h.digest() != manifest.checksums[key]:
        raise CorruptBlobError(where, f"checksum mismatch in tensor {key!r}")
    return out


def _chunks(
    view: memoryview, stored: tuple[int, ...], alloc: list[int], item: int
) -> list[memoryview]:
    """The regions of ``view`` (shape ``alloc``) that hold the stored tensor, in file order."""
    if list(stored) == alloc:
        return [view] if view.nbytes else []
    inner = math.prod(stored[3:]) * item
    rows = math.prod(stored[:2])
    size, stride = stored[2] * inner, alloc[2] * inner
    return [view[r * stride : r * stride + size] for r in range(rows) if size]
