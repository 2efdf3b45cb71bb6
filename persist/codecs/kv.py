"""Codecs for the growing attention caches: ``kv``, ``concat-kv``, ``chunked-kv``.

Each stores keys and values of shape (B, H, T, D) cut to the live positions:
never the zero tail of a step-allocated buffer, never positions removed by
``trim``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import servable
from ..errors import NotResumableError
from ..records import Record, RecordSpec, ResumeFacts
from .base import (
    LeafCodec,
    blank,
    cut,
    expect_tensor,
    expect_tensor_names,
    invalid,
    live,
    meta_int,
    room,
    step_capacity,
    with_capacity,
)

__all__ = ["KVCodec", "ConcatKVCodec", "ChunkedKVCodec"]

KV_NAMES = frozenset({"keys", "values"})


def check_kv_pair(spec: RecordSpec, length: int) -> None:
    """Keys and values present iff ``length > 0``, shaped (B, H, length, D)."""
    if length == 0:
        expect_tensor_names(spec, frozenset())
        return
    expect_tensor_names(spec, KV_NAMES)
    k = expect_tensor(spec, "keys", 4)
    v = expect_tensor(spec, "values", 4)
    if k.dtype != v.dtype:
        raise invalid(spec, f"keys are {k.dtype} but values are {v.dtype}")
    if k.shape[:2] != v.shape[:2] or k.shape[2] != length or v.shape[2] != length:
        raise invalid(spec, f"keys {k.shape} / values {v.shape} do not hold {length} positions")


def kv_bytes_per_token(keys: Any, values: Any) -> int:
    if keys is None:
        return 0
    b, h, _, dk = keys.shape
    dv = values.shape[3]
    return int(b * h * (dk * keys.dtype.size + dv * values.dtype.size))


def kv_pair(cache: Any, length: int, start: int = 0) -> dict[str, mx.array]:
    if cache.keys is None or length == 0:
        return {}
    return {"keys": live(cache.keys, length), "values": live(cache.values, length)}


class KVCodec(LeafCodec):
    """mlx-lm ``KVCache``: a step-allocated buffer plus ``offset``."""

    capabilities = frozenset({"attention"})

    def encode(self, cache: Any, kind: str) -> Record:
        n = int(cache.offset) if cache.keys is not None else 0
        return Record(kind, self.version, {"offset": n}, kv_pair(cache, n))

    def check(self, spec: RecordSpec) -> None:
        check_kv_pair(spec, meta_int(spec, "offset"))

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        return step_capacity(spec, cls, spec.meta["offset"])

    def decode(self, record: Record, cls: type[Any]) -> Any:
        c = blank(cls)
        c.keys = c.values = None
        c.offset = n = record.meta["offset"]
        if n:
            cap = room(n, cls)
            c.keys = with_capacity(record.tensors["keys"], cap)
            c.values = with_capacity(record.tensors["values"], cap)
        return c

    def trim(self, record: Record, n: int) -> Record:
        """The record a fresh prefill of the first ``n`` positions would give."""
        meta = {**record.meta, "offset": n}
        return Record(record.kind, record.version, meta, cut(record.tensors, n))

    def facts(self, cache: Any) -> ResumeFacts:
        return ResumeFacts(
            offset=int(cache.offset) if cache.keys is not None else 0,
            trimmable=True,
            min_resume_offset=0,
            bytes_per_token=kv_bytes_per_token(cache.keys, cache.values),
            token_axes={"keys": 2, "values": 2},
        )


class ConcatKVCodec(KVCodec):
    """mlx-lm ``ConcatenateKVCache``: exact-length arrays, grown by concatenation."""

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        return {}

    def decode(self, record: Record, cls: type[Any]) -> Any:
        c = blank(cls)
        c.keys = record.tensors.get("keys")
        c.values = record.tensors.get("values")
        c.offset = record.meta["offset"]
        return c

    def hides_positions(self, cache: Any) -> bool:
        """mlx-lm's trim of this class only lowers ``offset``: its arrays still hold
        the cut positions, and its next update appends after them."""
        return cache.keys is not None and int(cache.keys.shape[-2]) != int(cache.offset)


class ChunkedKVCodec(LeafCodec):
    """mlx-lm ``ChunkedKVCache``: holds positions [start_position, offset)."""

    capabilities = frozenset({"attention", "chunked"})

    def encode(self, cache: Any, kind: str) -> Record:
        start = int(cache.start_position)
        n = int(cache.offset) - start if cache.keys is not None else 0
        meta = {
            "offset": int(cache.offset),
            "start_position": start,
            "chunk_size": int(cache.chunk_size),
        }
        return Record(kind, self.version, meta, kv_pair(cache, n))

    def check(self, spec: RecordSpec) -> None:
        offset = meta_int(spec, "offset")
        start = meta_int(spec, "start_position", 0, offset)
        meta_int(spec, "chunk_size", 1)
        check_kv_pair(spec, offset - start)

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        return step_capacity(spec, cls, spec.meta["offset"] - spec.meta["start_position"])

    def decode(self, record: Record, cls: type[Any]) -> Any:
        m = record.meta
        c = blank(cls)
        c.keys = c.values = None
        c.offset = m["offset"]
        c.start_position = m["start_position"]
        c.chunk_size = m["chunk_size"]
        n = c.offset - c.start_position
        if record.tensors:
            cap = room(n, cls)
            c.keys = with_capacity(record.tensors["keys"], cap)
            c.values = with_capacity(record.tensors["values"], cap)
        return c

    def trim(self, record: Record, n: int) -> Record:
        start = record.meta["start_position"]
        floor = servable.chunked(record.meta).floor
        if n < floor:
            raise NotResumableError(
                f"chunked-kv: cannot trim to {n}, below {floor} (front {start})"
            )
        meta = {**record.meta, "offset": n}
        return Record(record.kind, record.version, meta, cut(record.tensors, n - start))

    def facts(self, cache: Any) -> ResumeFacts:
        start = int(cache.start_position)
        meta = {"offset": int(cache.offset), "start_position": start}
        rule = servable.chunked({**meta, "chunk_size": int(cache.chunk_size)})
        return ResumeFacts(
            offset=int(cache.offset),
            trimmable=rule.trimmable,
            min_resume_offset=rule.floor,
            bytes_per_token=kv_bytes_per_token(cache.keys, cache.values),
            token_axes={"keys": 2, "values": 2},
            first_token=start,
        )
