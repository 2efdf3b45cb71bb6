"""Codec for DeepSeek-V4's layer cache (``deepseek-v4-layer``; mlx-lm's deepseek_v41).

One ``LayerCache`` per decoder layer holds the sliding window, the closed
compressed groups (``compress_kv``), their index keys (``index_k``) and the
rows of the group still open (``pending_kv``, ``pending_gate``).  Any of them
may be None (a layer that does not compress) or hold zero rows (a group that
just closed): both are stored as themselves.  Evicted window rows and closed
groups are gone, so the cache is never trimmable; prefixes of these models
resume through checkpoints.
"""

from __future__ import annotations

from typing import Any

from ..records import FLOAT_DTYPES, Record, RecordSpec, ResumeFacts
from .base import LeafCodec, blank, expect_tensor, expect_tensor_names, invalid, meta_int

__all__ = ["DeepSeekV4LayerCodec", "FIELDS", "CLASS_PATH"]

CLASS_PATH = ("mlx_lm.models.deepseek_v41", "LayerCache")
FIELDS = ("window", "compress_kv", "index_k", "pending_kv", "pending_gate")


class DeepSeekV4LayerCodec(LeafCodec):
    capabilities = frozenset({"attention", "compressed"})

    def encode(self, cache: Any, kind: str) -> Record:
        tensors = {f: getattr(cache, f) for f in FIELDS if getattr(cache, f) is not None}
        meta = {
            "offset": int(cache.offset),
            "window_size": int(cache.window_size),
            "present": [f in tensors for f in FIELDS],
        }
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        offset = meta_int(spec, "offset")
        size = meta_int(spec, "window_size", 1)
        present = spec.meta.get("present")
        if (
            not isinstance(present, list)
            or len(present) != len(FIELDS)
            or any(type(p) is not bool for p in present)
        ):
            raise invalid(spec, f"meta 'present' must list {len(FIELDS)} booleans")
        names = frozenset(f for f, p in zip(FIELDS, present, strict=True) if p)
        expect_tensor_names(spec, names)
        lead = None
        for name in names:
            t = expect_tensor(spec, name, 3, FLOAT_DTYPES)
            if lead is not None and t.shape[0] != lead:
                raise invalid(spec, f"{name} holds {t.shape[0]} rows, not {lead}")
            lead = t.shape[0]
        if "window" in names and spec.tensors["window"].shape[1] > min(size, offset):
            raise invalid(spec, f"window holds more than {min(size, offset)} positions")
        pending = [spec.tensors[n].shape[1] for n in ("pending_kv", "pending_gate") if n in names]
        if len(set(pending)) > 1:
            raise invalid(spec, "pending rows and their gates differ in length")

    def decode(self, record: Record, cls: type[Any]) -> Any:
        c = blank(cls)
        c.window_size = record.meta["window_size"]
        c.offset = record.meta["offset"]
        for f in FIELDS:
            setattr(c, f, record.tensors.get(f))
        return c

    def facts(self, cache: Any) -> ResumeFacts:
        return ResumeFacts(
            offset=int(cache.offset), trimmable=False, min_resume_offset=0, bytes_per_token=0
        )
