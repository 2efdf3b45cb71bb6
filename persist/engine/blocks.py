"""Cut a snapshot into token blocks and a tail, and put it back together.

Block i holds, for every tensor that grows along the sequence from position
0, its slice for tokens [i*B, (i+1)*B).  The tail holds the last partial
block of those tensors and the whole state of every other tensor.  Blocks
are found by chained token hashes (layout-free, so a prompt can look them
up from its tokens alone) and stored under namespace-salted content keys,
so two snapshots share a block only if its bytes are identical.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from ..codecs.snapshot import Snapshot
from ..format.manifest import pack_snapshot_manifest, tensor_keys
from ..records import Record, TensorSpec
from ..storage.chains import HEAD_TOKENS, chain_root, chains, head_key

__all__ = [
    "HEAD_TOKENS",
    "chain_root",
    "chains",
    "head_key",
    "Piece",
    "Plan",
    "plan",
    "materialize",
    "content_key",
]


Rows = tuple[int, list[memoryview]]  # bytes per token, one flat view per (batch row, head)


@dataclass(frozen=True)
class Piece:
    key: str  # file key of the whole tensor ("3/keys")
    spec: TensorSpec  # of the piece
    data: Any  # host bytes of the piece: a numpy uint8 view shaped (*shape, itemsize)
    runs: list[memoryview] | None = None  # its contiguous runs, where the plan knows them


@dataclass(frozen=True, kw_only=True)
class Plan:
    records: list[Record]
    specs: dict[str, TensorSpec]  # whole tensors
    split: dict[str, int]  # whole-tensor key -> token axis
    n_blocks: int
    block: int
    n_tokens: int
    arrays: dict[str, Any]  # whole-tensor key -> host view (``snapshot.host_bytes``)
    rows: dict[str, Rows | None] = field(default_factory=dict)  # split key -> ``_token_rows``

    def block_pieces(self, i: int) -> list[Piece]:
        return [
            self._piece(k, a, i * self.block, (i + 1) * self.block) for k, a in self.split.items()
        ]

    def tail_pieces(self, n_tokens: int) -> list[Piece]:
        start = self.n_blocks * self.block
        out = [self._piece(k, a, start, n_tokens) for k, a in self.split.items()]
        out += [Piece(k, self.specs[k], t) for k, t in self.arrays.items() if k not in self.split]
        return out

    def _piece(self, key: str, axis: int, lo: int, hi: int) -> Piece:
        whole = self.arrays[key]
        idx: list[Any] = [slice(None)] * (whole.ndim - 1)  # the last axis is the item's bytes
        idx[axis] = slice(lo, hi)
        part = whole[tuple(idx)]
        spec = TensorSpec(self.specs[key].dtype, tuple(part.shape[:-1]))
        rows = self.rows.get(key)
        if rows is None:
            return Piece(key, spec, part)
        width, flat = rows
        return Piece(key, spec, part, [r[lo * width : hi * width] for r in flat])

    def manifest(self) -> bytes:
        return pack_snapshot_manifest(self.records, self.specs, self.split, self.block)


def plan(snap: Snapshot, block: int, dtype_name: Any) -> Plan:
    """Which tensors of ``snap`` are cut into blocks (those that grow from position 0).

    The record tensors must be evaluated (``capture`` does it); from here on
    a save works on host bytes only.
    """
    tensors = {key: rec.tensors[name] for key, rec, name in tensor_keys(snap.records)}
    specs = {k: TensorSpec(dtype_name(t), tuple(t.shape)) for k, t in tensors.items()}
    split: dict[str, int] = {}
    for i, f in enumerate(snap.facts):
        if f.first_token != 0 or f.offset is None:
            continue
        for axis_name, axis in f.token_axes.items():
            key = _key(i, axis_name)
            if key in specs and specs[key].shape[axis] == f.offset:
                split[key] = axis
    n = len(snap.tokens or [])
    rows = {k: _token_rows(snap.host[k], a) for k, a in split.items()}
    return Plan(
        records=snap.records,
        specs=specs,
        split=split,
        n_blocks=n // block,
        block=block,
        n_tokens=n,
        arrays=snap.host,
        rows=rows,
    )


def _key(layer: int, axis_name: str) -> str:
    # facts name tensors of inner caches "0.keys.q"; file keys are "3.0/keys.q"
    parts = axis_name.split(".")
    path = [str(layer)]
    while len(parts) > 1 and parts[0].isdigit():
        path.append(parts.pop(0))
    return ".".join(path) + "/" + ".".join(parts)


def _token_rows(whole: np.ndarray, axis: int) -> Rows | None:
    """One flat view per index before the token axis (batch row, head), when each
    holds its tokens contiguously, as every KV cache does: a block's runs are then
    slices of these, not views built per block (``None``: cut the general way).

    Every byte of every block is hashed on every save, the only sound way to know
    a block unchanged, so this is the save's inner loop."""
    inner = whole.shape[axis:]
    want = [math.prod(inner[j + 1 :]) for j in range(len(inner))]
    if whole.size == 0 or list(whole.strides[axis:]) != want:
        return None
    leads = np.ndindex(*whole.shape[:axis])
    return want[0], [whole[idx].reshape(-1).data for idx in leads]


Parts = list[memoryview]  # a piece's bytes as contiguous runs, in row-major order


def materialize(pieces: list[Piece]) -> list[tuple[Piece, Parts, bytes]]:
    """Each piece as contiguous runs of the cache's own host memory (no copy) and
    their checksum, hashed once here and trusted by the writer."""
    out = []
    for p in pieces:
        runs = p.runs if p.runs is not None else list(_runs(p.data))
        h = xxhash.xxh3_128()
        for r in runs:
            h.update(r)
        out.append((p, runs, h.digest()))
    return out


def _runs(a: np.ndarray) -> Iterator[memoryview]:
    """The contiguous runs of a strided view, in row-major order (a block cut along
    the token axis is one run per batch row and head)."""
    if a.flags.c_contiguous or a.size == 0:
        yield a.reshape(-1).data.cast("B") if a.size else memoryview(b"")
        return
    for sub in a:
        yield from _runs(sub)


def content_key(seed: bytes, role: bytes, parts: list[tuple[Piece, Parts, bytes]]) -> str:
    """Namespace-salted content key: equal only for equal bytes in one namespace."""
    h = xxhash.xxh3_128(seed=int.from_bytes(seed[:8], "little"))
    h.update(role)
    for p, _, s in parts:
        h.update(f"{p.key}|{p.spec.dtype}|{p.spec.shape}|".encode())
        h.update(s)
    return h.hexdigest()
