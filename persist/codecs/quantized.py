"""Codec for mlx-lm's ``QuantizedKVCache`` (``quantized-kv``).

Keys and values are each a (packed uint32, scales, biases) triple cut to the
live positions.  mlx-lm's cache does not remember when it was converted from
a plain KVCache (kv_bits with quantized_kv_start); positions below that
offset were quantized at once, so trimming below it gives a state no fresh
run produces.  Unless told (the ``min_resume_offset`` attribute persist sets
on caches it restores), the floor is the offset at the first save.
"""

from __future__ import annotations

from typing import Any

from .. import servable
from ..errors import NotResumableError
from ..records import FLOAT_DTYPES, Record, RecordSpec, ResumeFacts
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

__all__ = ["QuantizedKVCodec", "QUANT_BITS", "QUANT_GROUPS"]

QUANT_BITS = frozenset({2, 3, 4, 5, 6, 8})
QUANT_GROUPS = frozenset({32, 64, 128})
PARTS = ("q", "scales", "biases")
NAMES = frozenset(f"{kv}.{p}" for kv in ("keys", "values") for p in PARTS)


class QuantizedKVCodec(LeafCodec):
    capabilities = frozenset({"attention", "quantized"})

    def encode(self, cache: Any, kind: str) -> Record:
        n = int(cache.offset) if cache.keys is not None else 0
        if getattr(cache, "min_resume_offset", None) is None:
            # Pin the unknown conversion point at the first save, so later
            # saves of the same live cache agree with its restored copies.
            cache.min_resume_offset = n
        # A live cache cut below its floor outside persist (mlx-lm's trim) is
        # recorded at its own length; its facts keep the floor above it, so the
        # index's min_resume lets no lookup serve it (persist.servable.quantized).
        meta = {
            "offset": n,
            "bits": int(cache.bits),
            "group_size": int(cache.group_size),
            "min_resume_offset": min(self.facts(cache).min_resume_offset, n),
        }
        tensors = {}
        if n:
            for name, triple in (("keys", cache.keys), ("values", cache.values)):
                for part, arr in zip(PARTS, triple, strict=True):
                    tensors[f"{name}.{part}"] = live(arr, n)
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        n = meta_int(spec, "offset")
        meta_int(spec, "min_resume_offset", 0, n)
        bits = meta_int(spec, "bits", 1, 8)
        group = meta_int(spec, "group_size", 1, 1 << 16)
        if bits not in QUANT_BITS or group not in QUANT_GROUPS:
            raise invalid(spec, f"bits {bits} / group size {group} are not a legal quantization")
        if n == 0:
            expect_tensor_names(spec, frozenset())
            return
        expect_tensor_names(spec, NAMES)
        lead = None
        for name in ("keys", "values"):
            q = expect_tensor(spec, f"{name}.q", 4, frozenset({"U32"}))
            s = expect_tensor(spec, f"{name}.scales", 4, FLOAT_DTYPES)
            b = expect_tensor(spec, f"{name}.biases", 4, FLOAT_DTYPES)
            if s.shape != b.shape or s.dtype != b.dtype:
                raise invalid(spec, f"{name} scales {s.shape} and biases {b.shape} differ")
            if q.shape[:3] != s.shape[:3] or q.shape[2] != n:
                raise invalid(spec, f"{name} do not hold {n} positions: {q.shape}, {s.shape}")
            if q.shape[3] * 32 != s.shape[3] * group * bits:
                raise invalid(spec, f"{name} packing {q.shape} does not match {bits} bits")
            if lead is not None and lead != q.shape[:2]:
                raise invalid(spec, "keys and values disagree on batch or heads")
            lead = q.shape[:2]

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        return step_capacity(spec, cls, spec.meta["offset"])

    def decode(self, record: Record, cls: type[Any]) -> Any:
        m = record.meta
        c = blank(cls)
        c.offset, c.bits, c.group_size = m["offset"], m["bits"], m["group_size"]
        c.keys = c.values = None
        c.min_resume_offset = m["min_resume_offset"]
        if c.offset:
            cap = room(c.offset, cls)
            t = record.tensors
            c.keys = tuple(with_capacity(t[f"keys.{p}"], cap) for p in PARTS)
            c.values = tuple(with_capacity(t[f"values.{p}"], cap) for p in PARTS)
        return c

    def trim(self, record: Record, n: int) -> Record:
        floor = servable.quantized(record.meta).floor
        if n < floor:
            raise NotResumableError(f"quantized-kv: cannot trim to {n}, below its floor {floor}")
        meta = {**record.meta, "offset": n}
        return Record(record.kind, record.version, meta, cut(record.tensors, n))

    def facts(self, cache: Any) -> ResumeFacts:
        offset = int(cache.offset)
        floor = getattr(cache, "min_resume_offset", None)
        per_token = 0
        if cache.keys is not None:
            b, h = cache.keys[0].shape[:2]
            per_token = sum(
                int(b * h * a.shape[3] * a.dtype.size) for a in (*cache.keys, *cache.values)
            )
        return ResumeFacts(
            offset=offset,
            trimmable=True,
            min_resume_offset=servable.quantized(
                {"offset": offset, "min_resume_offset": offset if floor is None else int(floor)}
            ).floor,
            bytes_per_token=per_token,
            token_axes={f"{kv}.{p}": 2 for kv in ("keys", "values") for p in PARTS},
        )
