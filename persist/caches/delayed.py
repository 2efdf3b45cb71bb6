"""``DelayedQuantizedKVCache``: plain KV until ``start`` positions, then quantized.

mlx-lm's kv_bits conversion is an external function applied between forward
passes, so the conversion offset depends on where the prefill chunks end and
is never recorded.  This cache does it itself, exactly at ``start``, and
remembers the offset: positions below it were quantized at once, so its
``min_resume_offset`` is that offset (a state trimmed below it is one no
fresh run produces).  ``max_append_tokens()`` tells a forward how many
positions fit before the precision changes, so it can stop at the boundary.

Kind ``delayed-quantized(kv)`` before the switch, ``delayed-quantized(
quantized-kv)`` after; the inner cache is a plain mlx-lm cache.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..errors import InvalidArgumentError

__all__ = ["DelayedQuantizedKVCache"]


class DelayedQuantizedKVCache:
    def __init__(self, start: int, bits: int = 4, group_size: int = 64) -> None:
        if start < 0:
            raise InvalidArgumentError("start must be >= 0")
        self.start = start
        self.quant_bits = bits
        self.quant_group_size = group_size
        self.inner: Any = KVCache()
        self.converted_at: int | None = None

    # mlx-lm's attention picks quantized SDPA by hasattr(cache, "bits"):
    # expose bits and group_size only once the inner cache is quantized.
    def __getattr__(self, name: str) -> Any:
        if name in ("bits", "group_size") and isinstance(
            self.__dict__.get("inner"), QuantizedKVCache
        ):
            return getattr(self.inner, name)
        raise AttributeError(name)

    @property
    def offset(self) -> int:
        return int(self.inner.offset)

    @property
    def keys(self) -> Any:
        return self.inner.keys

    @property
    def values(self) -> Any:
        return self.inner.values

    @property
    def min_resume_offset(self) -> int:
        return self.converted_at or 0

    def max_append_tokens(self) -> int | None:
        """Positions that fit before the precision changes (None: it never will again).

        0 means the boundary is reached: the next forward converts first.
        """
        if self.converted_at is not None:
            return None
        return max(self.start - self.offset, 0)

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        room = self.max_append_tokens()
        if room is not None and keys.shape[2] > room > 0:
            raise InvalidArgumentError(
                f"this forward adds {keys.shape[2]} positions but the precision changes after "
                f"{room}; split it at max_append_tokens()"
            )
        if self.converted_at is None and self.offset >= self.start:
            # Convert before this forward appends, never inside one: the forward
            # that reached the boundary attended in full precision throughout.
            self.convert()
        return self.inner.update_and_fetch(keys, values)

    def convert(self) -> None:
        """Quantize in place now (done automatically by the first update at ``start``)."""
        self.converted_at = self.offset
        self.inner = self.inner.to_quantized(group_size=self.quant_group_size, bits=self.quant_bits)
        self.inner.min_resume_offset = self.converted_at  # what its codec records

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.make_mask(*args, **kwargs)

    def is_trimmable(self) -> bool:
        return bool(self.inner.is_trimmable())

    def trim(self, n: int) -> int:
        floor = self.converted_at or 0
        n = min(n, self.offset - floor)  # never below the conversion
        return int(self.inner.trim(n))

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return bool(self.inner.empty())

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def nbytes(self) -> int:
        return int(self.inner.nbytes)
