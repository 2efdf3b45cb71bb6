"""Codecs for mlx-lm's batched caches: ``batch-kv`` and ``batch-rotating-kv``.

The whole batch is stored as laid out (left padding included, since every
row's positions are relative to it), plus each row's offset and padding.
A batch whose prefill padding is not finalized is refused.  To resume one
row as its own session, extract it first (``persist.extract_row``): mlx-lm
gives a serial cache with its own offset, padding removed, ring de-rolled.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import servable
from ..errors import NotResumableError
from ..records import INT_DTYPES, Record, RecordSpec, ResumeFacts
from .base import (
    LeafCodec,
    blank,
    cut,
    expect_tensor,
    expect_tensor_names,
    invalid,
    live,
    meta_bool,
    meta_int,
    room,
    with_capacity,
)
from .kv import KV_NAMES, check_kv_pair

__all__ = ["BatchKVCodec", "BatchRotatingKVCodec"]

ROW_NAMES = frozenset({"offset", "left_padding"})


def check_rows(spec: RecordSpec, rows: int, length: int) -> None:
    names = ROW_NAMES | (KV_NAMES if length else frozenset())
    expect_tensor_names(spec, names)
    for n in ROW_NAMES:
        if expect_tensor(spec, n, 1, INT_DTYPES).shape[0] != rows:
            raise invalid(spec, f"{n} must hold one entry per row ({rows})")
    if length:
        check_kv_pair(
            RecordSpec(spec.kind, spec.version, spec.meta, {k: spec.tensors[k] for k in KV_NAMES}),
            length,
        )
        if spec.tensors["keys"].shape[0] != rows:
            raise invalid(spec, f"keys hold {spec.tensors['keys'].shape[0]} rows, not {rows}")


def row_vectors(cache: Any) -> dict[str, mx.array]:
    return {"offset": cache.offset, "left_padding": cache.left_padding}


def _single_row(record: Record, kind: str) -> int:
    """The offset of a one-row batch record; several rows have no single prefix."""
    offsets = record.tensors["offset"]
    if offsets.shape[0] != 1:
        raise NotResumableError(f"{kind}: a batch of several rows cannot be trimmed as one")
    return int(offsets[0].item())


def single_row_offset(cache: Any) -> int | None:
    return int(cache.offset[0].item()) if cache.offset.shape[0] == 1 else None


class BatchKVCodec(LeafCodec):
    capabilities = frozenset({"attention", "batched"})

    def encode(self, cache: Any, kind: str) -> Record:
        if getattr(cache, "_right_padding", None) is not None:
            raise NotResumableError("batch-kv: prefill padding not finalized (call finalize())")
        n = int(cache._idx) if cache.keys is not None else 0
        tensors = row_vectors(cache)
        if n:
            tensors |= {"keys": live(cache.keys, n), "values": live(cache.values, n)}
        meta = {"idx": n, "rows": int(cache.offset.shape[0])}
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        check_rows(spec, meta_int(spec, "rows", 1), meta_int(spec, "idx"))

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        n = spec.meta["idx"]
        cap = room(n, cls)
        return {"keys": cap, "values": cap} if n else {}

    def decode(self, record: Record, cls: type[Any]) -> Any:
        t = record.tensors
        c = blank(cls)
        c.offset, c.left_padding = t["offset"], t["left_padding"]
        c._idx = n = record.meta["idx"]
        c._right_padding = None
        c.keys = c.values = None
        if n:
            cap = room(n, cls)
            c.keys, c.values = with_capacity(t["keys"], cap), with_capacity(t["values"], cap)
        return c

    def trim(self, record: Record, n: int) -> Record:
        t = record.tensors
        drop = _single_row(record, "batch-kv") - n
        idx = record.meta["idx"] - drop
        kv = cut({k: t[k] for k in KV_NAMES if k in t}, idx)
        rows = {"offset": t["offset"] - drop, "left_padding": t["left_padding"]}
        return Record(record.kind, record.version, {**record.meta, "idx": idx}, rows | kv)

    def facts(self, cache: Any) -> ResumeFacts:
        return ResumeFacts(
            offset=single_row_offset(cache), trimmable=True, min_resume_offset=0, bytes_per_token=0
        )


class BatchRotatingKVCodec(LeafCodec):
    capabilities = frozenset({"attention", "rotating", "batched"})

    def encode(self, cache: Any, kind: str) -> Record:
        if getattr(cache, "_lengths", None) is not None:
            raise NotResumableError(
                "batch-rotating-kv: prefill padding not finalized (call finalize())"
            )
        tensors = row_vectors(cache)
        n = 0
        if cache.keys is not None:
            # Before the ring turns, slots from the write index on are unused.
            n = cache.keys.shape[2] if cache.rotated else int(cache._idx)
            tensors |= {"keys": live(cache.keys, n), "values": live(cache.values, n)}
        meta = {
            "rows": int(cache.offset.shape[0]),
            "max_size": int(cache.max_size),
            "position": int(cache._offset),
            "idx": int(cache._idx),
            "rotated": bool(cache.rotated),
            "length": n,
        }
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        rows = meta_int(spec, "rows", 1)
        meta_int(spec, "max_size", 1)
        position = meta_int(spec, "position")
        n = meta_int(spec, "length")
        idx = meta_int(spec, "idx", 0, n)
        rotated = meta_bool(spec, "rotated")
        if (not rotated and idx != n) or n > position:
            raise invalid(spec, f"ring of {n} positions, index {idx}, position {position}")
        check_rows(spec, rows, n)

    def decode(self, record: Record, cls: type[Any]) -> Any:
        m, t = record.meta, record.tensors
        c = blank(cls)
        c.keys, c.values = t.get("keys"), t.get("values")
        c.offset, c.left_padding = t["offset"], t["left_padding"]
        c.max_size, c._offset, c._idx = m["max_size"], m["position"], m["idx"]
        c.rotated = m["rotated"]
        c._lengths = None
        return c

    def trim(self, record: Record, n: int) -> Record:
        m, t = record.meta, record.tensors
        if not servable.batch_rotating(m).trimmable:
            raise NotResumableError("batch-rotating-kv: a ring that has wrapped cannot be trimmed")
        drop = _single_row(record, "batch-rotating-kv") - n
        idx = m["idx"] - drop
        kv = cut({k: t[k] for k in KV_NAMES if k in t}, idx)
        rows = {"offset": t["offset"] - drop, "left_padding": t["left_padding"]}
        meta = {**m, "idx": idx, "length": idx, "position": m["position"] - drop}
        return Record(record.kind, record.version, meta, rows | kv)

    def facts(self, cache: Any) -> ResumeFacts:
        return ResumeFacts(
            offset=single_row_offset(cache),
            trimmable=servable.batch_rotating(
                {
                    "rotated": bool(cache.rotated),
                    "position": int(cache._offset),
                    "max_size": int(cache.max_size),
                }
            ).trimmable,
            min_resume_offset=0,
            bytes_per_token=0,
        )
