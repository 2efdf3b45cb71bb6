"""Incremental saves: a session saved again from the same cache objects reuses the
blocks its last save (or restore) in this process wrote, without hashing them again.

Hashing every block of an 8k-token session costs most of a save; a turn adds a
few hundred tokens to it.  A block of the new save is taken from the session's
previous snapshot, unhashed, only when all of this holds:

- the cache is the same list of layer objects, of the same kinds, and every
  tensor cut into blocks has the same dtype and shape (token axis aside);
- every layer's offset is at least the offset it had then, and the block's
  chain (all tokens up to its end) is the same;
- the block's last position, in every tensor cut into blocks, has the bytes it
  had then (a fingerprint of 1/256 of the data).  A cache trimmed into the
  block and extended again rewrites that position, so the block is hashed and
  written as new whenever what was computed there changed.

The memo lives in the Store object (one process); the commit re-checks that
the reused blob files are alive, and a save that must retry does not reuse.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import xxhash

from ..codecs.base import dtype_name
from ..codecs.snapshot import Snapshot, capture
from ..format.tensors import on_cuda
from ..format.tokens import unpack_tokens
from ..store.rows import BlockRef, SnapshotRow
from .blocks import Plan, plan

__all__ = ["Lineage", "remember", "remember_restored", "reusable"]


@dataclass(frozen=True)
class Lineage:
    identity: str  # digest
    layers: list[weakref.ref[Any]]
    offsets: list[int | None]
    kinds: list[str]
    shapes: dict[str, tuple[str, tuple[int, ...], int]]  # split key -> dtype, shape, axis
    refs: list[BlockRef]  # the snapshot's blocks
    marks: list[bytes]  # per block: the fingerprint of its last position


def _shapes(plan: Plan) -> dict[str, tuple[str, tuple[int, ...], int]]:
    out = {}
    for key, axis in plan.split.items():
        spec = plan.specs[key]
        shape = tuple(d for j, d in enumerate(spec.shape) if j != axis)
        out[key] = (spec.dtype, shape, axis)
    return out


def mark(plan: Plan, i: int) -> bytes:
    """The bytes of block ``i``'s last position in every tensor cut into blocks, hashed."""
    h = xxhash.xxh3_128()
    pos = (i + 1) * plan.block - 1
    for key in sorted(plan.split):
        whole = plan.arrays[key]  # (*shape, itemsize) uint8 view
        idx: list[Any] = [slice(None)] * (whole.ndim - 1)
        idx[plan.split[key]] = pos
        h.update(key.encode())
        h.update(np.ascontiguousarray(whole[tuple(idx)]).data)
    return h.digest()


def remember(
    cache: Sequence[Any] | Snapshot,
    snap: Snapshot,
    plan: Plan,
    identity: str,
    refs: list[BlockRef],
) -> Lineage | None:
    """What a later save of this session from the same cache objects may reuse."""
    if isinstance(cache, Snapshot) or not plan.split or not refs:
        return None  # captured elsewhere: no objects to recognise
    try:
        layers = [weakref.ref(c) for c in cache]
    except TypeError:  # a layer type without weak references: no memo
        return None
    return Lineage(
        identity,
        layers,
        [f.offset for f in snap.facts],
        [r.kind for r in snap.records],
        _shapes(plan),
        list(refs),
        [mark(plan, r.idx) for r in refs],
    )


def reusable(
    memo: Lineage | None,
    cache: Sequence[Any] | Snapshot,
    snap: Snapshot,
    plan: Plan,
    identity: str,
    chs: list[bytes],
) -> dict[int, str]:
    """Block index -> blob file of the blocks this save takes from ``memo`` unhashed."""
    if memo is None or isinstance(cache, Snapshot) or memo.identity != identity:
        return {}
    if len(cache) != len(memo.layers) or any(
        w() is not c for w, c in zip(memo.layers, cache, strict=True)
    ):
        return {}
    if [r.kind for r in snap.records] != memo.kinds or _shapes(plan) != memo.shapes:
        return {}
    now = [f.offset for f in snap.facts]
    if any(a is None or b is None or a < b for a, b in zip(now, memo.offsets, strict=True)):
        return {}
    out: dict[int, str] = {}
    for ref, old in zip(memo.refs, memo.marks, strict=True):
        i = ref.idx
        if ref.blob is None or i >= plan.n_blocks or chs[i + 1] != ref.chain:
            break
        if mark(plan, i) != old:
            break  # rewritten since (a trim into this block): this one and later ones anew
        out[i] = ref.blob
    return out


def remember_restored(
    lineages: dict[tuple[str, str], Lineage],
    key: tuple[str, str],
    cache: list[Any],
    row: SnapshotRow,
    refs: list[BlockRef],
) -> None:
    """After a restore: the restored objects hold the row's blocks byte for byte.

    Not on CUDA: the fingerprints read the arrays on the host, which would move
    the fresh cache out of device memory (``format.tensors.on_cuda``)."""
    lineages.pop(key, None)
    if on_cuda():
        return
    snap = capture(cache, unpack_tokens(row.tokens))
    p = plan(snap, int(msgpack.unpackb(row.manifest, raw=False)["block"]), dtype_name)
    if (memo := remember(cache, snap, p, row.identity, refs)) is not None:
        lineages[key] = memo
