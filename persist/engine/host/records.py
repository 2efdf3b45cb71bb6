"""How the host tier copies codec records: in, out, and through a holder's pages.

A hit is handed out in buffers of its own (``copy.deepcopy`` of an
``mx.array`` shares its buffer): mlx-lm updates a live cache in place and a
caller may write one through a memoryview.  With a holder
(``cuda.pinned_pool``) a kept record holds ``SLOT`` where its arrays were,
refilled in the same order on a hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

from ...codecs import capacity_of
from ...codecs.base import dtype_name, with_capacity
from ...format.tensors import device_copy
from ...records import Record

__all__ = ["SLOT", "arrays_of", "own", "copied", "emptied", "filled", "handed_out"]


def arrays_of(records: Sequence[Record]) -> list[Any]:
    """Every array of the records: tensors in order, then each child's."""
    out: list[Any] = []
    for r in records:
        out += [t for t in r.tensors.values() if isinstance(t, mx.array)]
        out += arrays_of(r.children)
    return out


class Slot:
    """Where a kept record's array was: its bytes are in the entry's pages."""


SLOT = Slot()


def own(a: Any) -> Any:
    """``a`` in a buffer of its own (bit-exact); an empty array has no buffer to share."""
    if not isinstance(a, mx.array) or a.size == 0:
        return a
    if a.dtype == mx.bool_:
        return mx.logical_or(a, mx.array(False))
    return device_copy(a)


def copied(r: Record) -> Record:
    """``r`` with every array in a buffer of its own."""
    return dataclasses.replace(
        r,
        tensors={k: own(v) for k, v in r.tensors.items()},
        children=tuple(copied(c) for c in r.children),
    )


def emptied(r: Record) -> Record:
    """``r`` without its arrays (they are in pages now): nothing on the device stays."""
    return dataclasses.replace(
        r,
        tensors={k: SLOT if isinstance(v, mx.array) else v for k, v in r.tensors.items()},
        children=tuple(emptied(c) for c in r.children),
    )


def filled(r: Record, arrays: Iterator[mx.array]) -> Record:
    """``emptied``'s inverse: the arrays in ``arrays_of``' order (tensors, then children)."""
    tensors = {k: next(arrays) if v is SLOT else v for k, v in r.tensors.items()}
    return dataclasses.replace(
        r, tensors=tensors, children=tuple(filled(c, arrays) for c in r.children)
    )


def handed_out(r: Record, fresh: frozenset[int] = frozenset()) -> Record:
    """``r`` in buffers of its own, each written once: a tensor the codec gives room
    (``capacity_of``: a KV cache's step-rounded buffer) is grown into a new one, as
    ``loading`` reads it into one, and its decode takes it as it is; the rest are
    copied (a decode may keep a record's tensor as its cache's array), but for
    arrays just unpacked from pages (ids in ``fresh``), which nothing else holds."""
    caps = capacity_of(r.spec(dtype_name))
    tensors = {}
    for k, v in r.tensors.items():
        cap = caps.get(k)
        grow = cap is not None and isinstance(v, mx.array) and v.ndim > 2 and cap > v.shape[2]
        if grow and cap is not None:
            tensors[k] = with_capacity(v, cap)
        else:
            tensors[k] = v if id(v) in fresh else own(v)
    return dataclasses.replace(
        r, tensors=tensors, children=tuple(handed_out(c, fresh) for c in r.children)
    )
