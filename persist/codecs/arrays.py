"""Codec for mlx-lm's ``ArraysCache`` (``arrays``): recurrent state slots.

Mamba and gated-DeltaNet layers keep a convolution state and a recurrent
state; a slot may be None before the first forward.  Batched prefill adds
``left_padding`` and ``lengths`` vectors, stored when present.  The state
does not grow with the sequence and cannot be trimmed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..records import FLOAT_DTYPES, INT_DTYPES, Record, RecordSpec, ResumeFacts
from .base import LeafCodec, blank, expect_tensor, expect_tensor_names, invalid, meta_int

__all__ = ["ArraysCodec"]

MAX_SLOTS = 64
VECTORS = ("left_padding", "lengths")


class ArraysCodec(LeafCodec):
    capabilities = frozenset({"recurrent"})

    def encode(self, cache: Any, kind: str) -> Record:
        slots = list(cache.cache)
        tensors: dict[str, mx.array] = {f"slot{i}": a for i, a in enumerate(slots) if a is not None}
        for name in VECTORS:
            v = getattr(cache, name, None)
            if v is not None:
                tensors[name] = v
        meta = {"size": len(slots), "present": [a is not None for a in slots]}
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        size = meta_int(spec, "size", 0, MAX_SLOTS)
        present = spec.meta.get("present")
        if not isinstance(present, list) or len(present) != size:
            raise invalid(spec, f"meta 'present' must list {size} booleans")
        if any(type(p) is not bool for p in present):
            raise invalid(spec, "meta 'present' must list booleans")
        names = {f"slot{i}" for i, p in enumerate(present) if p}
        names |= {n for n in VECTORS if n in spec.tensors}
        expect_tensor_names(spec, frozenset(names))
        rows = set()
        for i, p in enumerate(present):
            if p:
                t = spec.tensors[f"slot{i}"]
                if t.dtype not in FLOAT_DTYPES | INT_DTYPES or not 1 <= len(t.shape) <= 6:
                    raise invalid(spec, f"slot {i} has dtype {t.dtype} and shape {t.shape}")
                rows.add(t.shape[0])
        for n in VECTORS:
            if n in spec.tensors:
                rows.add(expect_tensor(spec, n, 1, INT_DTYPES).shape[0])
        if len(rows) > 1:
            raise invalid(spec, f"slots disagree on the batch size: {sorted(rows)}")

    def decode(self, record: Record, cls: type[Any]) -> Any:
        c = blank(cls)
        t = record.tensors
        c.cache = [t.get(f"slot{i}") for i in range(record.meta["size"])]
        c.left_padding = t.get("left_padding")
        c.lengths = t.get("lengths")
        return c

    def facts(self, cache: Any) -> ResumeFacts:
        return ResumeFacts(offset=None, trimmable=False, min_resume_offset=0, bytes_per_token=0)
