"""``GatedDeltaCache`` (kind ``gated-delta``): the recurrent state of one
gated-DeltaNet layer, as mlx-lm's qwen3_next linear-attention layers use it.

It is an ``ArraysCache`` of two slots (convolution state, recurrent state)
that also knows its own offset: the layer calls ``advance(S)`` after each
forward, and each row's offset grows by its real (unpadded) positions.  Its
state does not grow with the sequence (``bytes_per_token() == 0``) and can
never be trimmed.  A cache whose padded prefill is not finalized cannot be
persisted.

This increment covers offsets, persistence and ``make_cache``; speculative
rounds and replay are still to come (issue 7).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

__all__ = ["GatedDeltaCache", "make_cache", "row_offset"]


def row_offset(offsets: Any) -> int:
    """The offset of a one-row ``offsets`` vector."""
    value: Any = offsets.item()
    return int(value)


class GatedDeltaCache(ArraysCache):
    def __init__(self, left_padding: list[int] | None = None) -> None:
        super().__init__(2, left_padding=left_padding)
        rows = len(left_padding) if left_padding else 1
        self.offsets = mx.zeros((rows,), dtype=mx.int32)

    @property
    def offset(self) -> int:
        """Positions this cache covers (one row; a batch has ``offsets``)."""
        if self.offsets.size != 1:
            raise ValueError("a batch of several rows has one offset per row: use .offsets")
        return row_offset(self.offsets)

    def advance(self, n: int) -> None:
        real = mx.full(self.offsets.shape, n, dtype=mx.int32)
        if self.lengths is not None:
            real = mx.minimum(real, mx.maximum(self.lengths, 0))
        if self.left_padding is not None:
            real = real - mx.clip(self.left_padding, 0, n)
        self.offsets = self.offsets + mx.maximum(real, 0).astype(mx.int32)
        super().advance(n)

    def bytes_per_token(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return False

    def padding_pending(self) -> bool:
        return self.left_padding is not None or self.lengths is not None

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        self.offsets = self.offsets[batch_indices]

    def extract(self, idx: int) -> GatedDeltaCache:
        c = GatedDeltaCache()
        c.cache = [x[idx : idx + 1] if x is not None else None for x in self.cache]
        c.offsets = self.offsets[idx : idx + 1]
        return c


def make_cache(model: Any, max_kv_size: int | None = None) -> list[Any]:
    """mlx-lm's ``make_prompt_cache``, with a GatedDeltaCache for each gated-DeltaNet layer."""
    caches = make_prompt_cache(model, max_kv_size)
    for i, layer in enumerate(getattr(model, "layers", [])):
        if getattr(layer, "is_linear", False) and type(caches[i]) is ArraysCache:
            caches[i] = GatedDeltaCache()
    return caches
