"""Codec for ``GatedDeltaCache`` (``gated-delta``): two state slots and row offsets."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..caches.gated_delta import row_offset
from ..errors import NotResumableError
from ..records import INT_DTYPES, Record, RecordSpec, ResumeFacts
from .arrays import ArraysCodec
from .base import expect_tensor, invalid

__all__ = ["GatedDeltaCodec"]


class GatedDeltaCodec(ArraysCodec):
    capabilities = frozenset({"recurrent"})

    def encode(self, cache: Any, kind: str) -> Record:
        if cache.round_armed:
            raise NotResumableError(
                "gated-delta: a speculative round is armed (commit or roll it back first)"
            )
        if cache.padding_pending():
            raise NotResumableError("gated-delta: padded prefill not finalized (call finalize())")
        rec = super().encode(cache, kind)
        return Record(kind, self.version, rec.meta, {**rec.tensors, "offsets": cache.offsets})

    def check(self, spec: RecordSpec) -> None:
        offsets = expect_tensor(spec, "offsets", 1, INT_DTYPES)
        rest = {k: v for k, v in spec.tensors.items() if k != "offsets"}
        if set(rest) & {"left_padding", "lengths"}:
            raise invalid(spec, "a persisted gated-delta cache has no pending padding")
        super().check(RecordSpec(spec.kind, spec.version, spec.meta, rest, spec.children))
        rows = {t.shape[0] for t in rest.values()}
        if rows and rows != {offsets.shape[0]}:
            raise invalid(spec, f"{offsets.shape[0]} offsets for rows {sorted(rows)}")

    def decode(self, record: Record, cls: type[Any]) -> Any:
        rest = {k: v for k, v in record.tensors.items() if k != "offsets"}
        c = super().decode(Record(record.kind, record.version, record.meta, rest), cls)
        c.offsets = record.tensors["offsets"].astype(mx.int32)
        return c

    def facts(self, cache: Any) -> ResumeFacts:
        rows = cache.offsets.size
        return ResumeFacts(
            offset=row_offset(cache.offsets) if rows == 1 else None,
            trimmable=False,
            min_resume_offset=0,
            bytes_per_token=0,
        )
