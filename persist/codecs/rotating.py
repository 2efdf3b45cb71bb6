"""Codec for mlx-lm's ``RotatingKVCache`` (``rotating-kv``): a sliding window.

A wrapped ring is stored in its physical layout with its write index:
attention sums in ring order, so a re-ordered ring would not continue
bit-exactly.  A buffer that a long prefill left larger than the window is
compacted to what the next update keeps (the ``keep`` head and the last
``max_size - keep`` positions); mlx-lm drops the rest on its next update.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import servable
from ..errors import NotResumableError
from ..records import Record, RecordSpec, ResumeFacts
from .base import LeafCodec, blank, cut, invalid, meta_int, round_up, with_capacity
from .kv import check_kv_pair, kv_bytes_per_token

__all__ = ["RotatingKVCodec", "ring_layout"]


def ring_layout(cache: Any) -> tuple[mx.array | None, mx.array | None, int]:
    """(keys, values, write index) holding only the live part of the ring."""
    if cache.keys is None:
        return None, None, int(cache._idx)
    offset, idx, keep, max_size = (
        int(cache.offset),
        int(cache._idx),
        int(cache.keep),
        int(cache.max_size),
    )
    keys, values = cache.keys, cache.values
    physical = keys.shape[2]
    # Never wrapped: slots at and after the write index are unused or trimmed.
    n = idx if offset == idx else physical
    if n > max_size and idx == physical:
        tail = max_size - keep
        keys = mx.concatenate([keys[..., :keep, :], keys[..., n - tail : n, :]], axis=2)
        values = mx.concatenate([values[..., :keep, :], values[..., n - tail : n, :]], axis=2)
        return keys, values, max_size
    return keys[..., :n, :], values[..., :n, :], idx


class RotatingKVCodec(LeafCodec):
    capabilities = frozenset({"attention", "rotating"})

    def encode(self, cache: Any, kind: str) -> Record:
        keys, values, idx = ring_layout(cache)
        meta = {
            "offset": int(cache.offset),
            "keep": int(cache.keep),
            "max_size": int(cache.max_size),
            "idx": idx,
        }
        tensors = {} if keys is None else {"keys": keys, "values": values}
        return Record(kind, self.version, meta, tensors)

    def check(self, spec: RecordSpec) -> None:
        offset = meta_int(spec, "offset")
        max_size = meta_int(spec, "max_size", 1)
        keep = meta_int(spec, "keep", 0, max_size)
        idx = meta_int(spec, "idx", 0, max_size)
        n = spec.tensors["keys"].shape[2] if "keys" in spec.tensors else 0
        if n == 0 and spec.tensors:
            raise invalid(spec, "an empty ring stores no tensors")
        check_kv_pair(spec, n)
        if n > max_size or n > offset:
            raise invalid(spec, f"ring holds {n} positions, max_size {max_size}, offset {offset}")
        if offset == idx and n != idx:
            raise invalid(spec, f"unwrapped ring holds {n} positions, write index {idx}")
        if offset != idx and n and (n != max_size or not keep <= idx):
            raise invalid(spec, f"wrapped ring of {n}/{max_size}, index {idx}, keep {keep}")

    def capacity(self, spec: RecordSpec, cls: type[Any]) -> dict[str, int]:
        m = spec.meta
        if not spec.tensors or m["offset"] != m["idx"]:
            return {}  # a wrapped ring is restored exactly as it was
        # An unwrapped ring gets the step-rounded room a live one would have.
        cap = min(m["max_size"], round_up(m["idx"], getattr(cls, "step", 256)))
        return dict.fromkeys(spec.tensors, cap)

    def decode(self, record: Record, cls: type[Any]) -> Any:
        m = record.meta
        c = blank(cls)
        c.keep, c.max_size, c.offset, c._idx = m["keep"], m["max_size"], m["offset"], m["idx"]
        c.keys = c.values = None
        if record.tensors:
            keys, values = record.tensors["keys"], record.tensors["values"]
            if c.offset == c._idx:
                cap = min(c.max_size, round_up(c._idx, getattr(cls, "step", 256)))
                keys, values = with_capacity(keys, cap), with_capacity(values, cap)
            c.keys, c.values = keys, values
        return c

    def trim(self, record: Record, n: int) -> Record:
        m = record.meta
        if not servable.rotating(m).trimmable:
            raise NotResumableError("rotating-kv: a ring that has wrapped cannot be trimmed")
        meta = {**m, "offset": n, "idx": n}
        return Record(record.kind, record.version, meta, cut(record.tensors, n))

    def facts(self, cache: Any) -> ResumeFacts:
        offset, max_size = int(cache.offset), int(cache.max_size)
        in_order = offset == int(cache._idx) and offset <= max_size
        meta = {"offset": offset, "idx": int(cache._idx), "max_size": max_size}
        return ResumeFacts(
            offset=offset,
            trimmable=servable.rotating(meta).trimmable,
            min_resume_offset=0,
            bytes_per_token=kv_bytes_per_token(cache.keys, cache.values) if in_order else 0,
            token_axes={"keys": 2, "values": 2} if in_order else {},
        )
