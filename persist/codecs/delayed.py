"""Codec for ``DelayedQuantizedKVCache``: ``delayed-quantized(<inner>)``.

The wrapper records its own settings and the conversion offset; the inner
cache is encoded by its own codec, so an unknown inner kind fails closed.
"""

from __future__ import annotations

from typing import Any

from .. import servable
from ..errors import NotResumableError
from ..records import Record, RecordSpec, ResumeFacts
from .base import blank, expect_tensor_names, invalid, meta_int, meta_opt_int
from .dispatch import decode_record, encode_cache, facts_of, trim_record

__all__ = ["DelayedQuantizedCodec"]


class DelayedQuantizedCodec:
    version = 1
    wrapper = True
    capabilities = frozenset({"delayed-quantized"})

    def children(self, cache: Any) -> list[Any]:
        return [cache.inner]

    def encode(self, cache: Any, kind: str) -> Record:
        meta = {
            "start": cache.start,
            "bits": cache.quant_bits,
            "group_size": cache.quant_group_size,
            "converted_at": cache.converted_at,
        }
        return Record(kind, self.version, meta, {}, (encode_cache(cache.inner),))

    def check(self, spec: RecordSpec) -> None:
        expect_tensor_names(spec, frozenset())
        start = meta_int(spec, "start")
        meta_int(spec, "bits", 1, 8)
        meta_int(spec, "group_size", 1, 1 << 16)
        converted = meta_opt_int(spec, "converted_at")
        if len(spec.children) != 1:
            raise invalid(spec, "a delayed-quantized cache holds exactly one inner cache")
        quantized = spec.children[0].kind == "quantized-kv"
        if quantized != (converted is not None) or (converted is not None and converted < start):
            raise invalid(spec, f"inner {spec.children[0].kind} with conversion at {converted}")

    def decode(self, record: Record, cls: type[Any]) -> Any:
        m = record.meta
        c = blank(cls)
        c.start, c.quant_bits, c.quant_group_size = m["start"], m["bits"], m["group_size"]
        c.converted_at = m["converted_at"]
        c.inner = decode_record(record.children[0])
        if c.converted_at is not None:
            c.inner.min_resume_offset = c.converted_at
        return c

    def trim(self, record: Record, n: int) -> Record:
        converted = record.meta["converted_at"]
        if n < servable.delayed(record.meta).floor:
            raise NotResumableError(f"delayed-quantized: cannot trim to {n}, below {converted}")
        kids = (trim_record(record.children[0], n),)
        return Record(record.kind, record.version, record.meta, record.tensors, kids)

    def facts(self, cache: Any) -> ResumeFacts:
        inner = facts_of(cache.inner)
        rule = servable.delayed(
            {"converted_at": cache.converted_at},
            [servable.Servable(inner.trimmable, inner.min_resume_offset)],
        )
        return ResumeFacts(
            offset=inner.offset,
            trimmable=rule.trimmable,
            min_resume_offset=rule.floor,
            bytes_per_token=inner.bytes_per_token,
            token_axes={f"0.{k}": a for k, a in inner.token_axes.items()},
            first_token=inner.first_token,
        )
