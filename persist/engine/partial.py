"""A partial read (a hit of k tokens) sized so that decoding copies nothing.

A trimmed KV record decodes into buffers with the step-rounded room of k
positions; a buffer read with only the blocks that cover k would be grown
by a copy of every byte.  So the split tensors get that room up front:
``room_for`` asks each codec, through its own ``trim`` and ``capacity`` on
never-evaluated placeholders, how long the trimmed tensor is and how much
room it wants.  After the read, positions past k are zeroed (as a fresh
prefill's room is) and ``keep_buffers`` hands the whole buffer to decoding
in place of the trimmed slice.

Sound because a split tensor holds position i at index i (blocks.plan):
trimming it to k keeps exactly its first positions, which the buffer holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..codecs import capacity_of, trim_record
from ..format.tensors import NAME_TO_MX, dtype_name
from ..records import DTYPE_SIZES, Record, RecordSpec

__all__ = ["room_for", "zero_past", "keep_buffers"]

Room = dict[str, tuple[int, int]]  # split tensor key -> (trimmed length, room to allocate)


def room_for(specs: list[RecordSpec], split: dict[str, int], keep: int, filled: int) -> Room:
    """Split tensors whose trimmed record wants room for at least the ``filled``
    positions a partial read writes; the rest keep exactly ``filled`` positions."""
    out: Room = {}
    for i, spec in enumerate(specs):
        _walk(trim_record(_placeholder(spec), keep), str(i), split, filled, out)
    return out


def _placeholder(spec: RecordSpec) -> Record:
    # lazy zeros: the codecs read shapes and meta from them, nothing is computed
    tensors = {n: mx.zeros(t.shape, dtype=NAME_TO_MX[t.dtype]) for n, t in spec.tensors.items()}
    kids = tuple(_placeholder(c) for c in spec.children)
    return Record(spec.kind, spec.version, spec.meta, tensors, kids)


def _walk(rec: Record, path: str, split: dict[str, int], filled: int, out: Room) -> None:
    caps = capacity_of(rec.spec(dtype_name))
    for name, t in rec.tensors.items():
        key, cap = f"{path}/{name}", caps.get(name)
        if key in split and cap is not None and cap >= max(filled, t.shape[split[key]]):
            out[key] = (t.shape[split[key]], cap)
    for j, c in enumerate(rec.children):
        _walk(c, f"{path}.{j}", split, filled, out)


def zero_past(view: memoryview, shape: tuple[int, ...], dtype: str, axis: int, n: int) -> None:
    """Zero positions ``n`` onwards along ``axis`` of the buffer behind ``view``."""
    if view.nbytes == 0:
        return
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64)) * DTYPE_SIZES[dtype]
    arr = np.frombuffer(view, dtype=np.uint8).reshape(*shape[: axis + 1], inner)
    arr[(slice(None),) * axis + (slice(n, None),)] = 0


def keep_buffers(trimmed: Record, whole: Record, path: str, room: Room) -> Record:
    """``trimmed`` with each split tensor given room replaced by its whole buffer (from
    the untrimmed ``whole``, its positions past the trim already zeroed)."""
    tensors = {
        name: whole.tensors[name] if f"{path}/{name}" in room else t
        for name, t in trimmed.tensors.items()
    }
    kids = tuple(
        keep_buffers(c, w, f"{path}.{j}", room)
        for j, (c, w) in enumerate(zip(trimmed.children, whole.children, strict=True))
    )
    return Record(trimmed.kind, trimmed.version, trimmed.meta, tensors, kids)
