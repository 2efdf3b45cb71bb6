"""Codec for mlx-lm's ``CacheList`` (``cache-list(inner,...)``).

A wrapper records its own kind and every inner kind; the inner records are
encoded and checked by their own codecs, so an unknown inner kind fails
closed exactly like an unknown outer one.
"""

from __future__ import annotations

from typing import Any

from .. import policy, servable
from ..records import Record, RecordSpec, ResumeFacts
from .base import blank, expect_tensor_names, invalid, meta_int
from .dispatch import decode_record, encode_cache, facts_of, trim_record

__all__ = ["CacheListCodec", "combine_facts"]


def combine_facts(parts: list[ResumeFacts]) -> ResumeFacts:
    offset = policy.common_offset((f.offset for f in parts), "inner caches")
    axes = {f"{i}.{k}": a for i, f in enumerate(parts) for k, a in f.token_axes.items()}
    starts = {f.first_token for f in parts if f.token_axes}
    rule = servable.every_part(
        {}, [servable.Servable(f.trimmable, f.min_resume_offset) for f in parts]
    )
    return ResumeFacts(
        offset=offset,
        trimmable=rule.trimmable,
        min_resume_offset=rule.floor,
        bytes_per_token=sum(f.bytes_per_token for f in parts),
        token_axes=axes if len(starts) <= 1 else {},
        first_token=starts.pop() if len(starts) == 1 else 0,
    )


class CacheListCodec:
    version = 1
    wrapper = True
    capabilities: frozenset[str] = frozenset()

    def children(self, cache: Any) -> list[Any]:
        return list(cache.caches)

    def encode(self, cache: Any, kind: str) -> Record:
        inner = tuple(encode_cache(c) for c in cache.caches)
        return Record(kind, self.version, {"n": len(inner)}, {}, inner)

    def check(self, spec: RecordSpec) -> None:
        n = meta_int(spec, "n", 1, 64)
        expect_tensor_names(spec, frozenset())
        if n != len(spec.children):
            raise invalid(spec, f"meta says {n} inner caches, record has {len(spec.children)}")

    def decode(self, record: Record, cls: type[Any]) -> Any:
        c = blank(cls)
        c.caches = tuple(decode_record(r) for r in record.children)
        return c

    def trim(self, record: Record, n: int) -> Record:
        kids = tuple(trim_record(c, n) for c in record.children)
        return Record(record.kind, record.version, record.meta, record.tensors, kids)

    def facts(self, cache: Any) -> ResumeFacts:
        return combine_facts([facts_of(c) for c in cache.caches])
