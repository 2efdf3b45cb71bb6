"""Golden cases: deterministic caches of every kind and a probe of their behaviour.

The probe feeds a cache fixed updates and hashes what it returns, so it tests
what a restored cache *does*, independent of how later versions lay it out.
Inputs come from numpy's legacy RandomState, whose stream never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models import cache as mc

from persist import ModelIdentity

H, D = 2, 8


def arr(seed: int, shape: tuple[int, ...], dtype: Any = mx.bfloat16) -> mx.array:
    data = np.random.RandomState(seed).standard_normal(shape).astype(np.float32)
    return mx.array(data).astype(dtype)


def kvs(seed: int, n: int, b: int = 1, d: int = D) -> tuple[mx.array, mx.array]:
    return arr(seed, (b, H, n, d)), arr(seed + 1, (b, H, n, d))


def kv_cache(n: int, seed: int = 1) -> Any:
    """A plain KVCache holding ``n`` positions of ``kvs(seed, n)``."""
    c = mc.KVCache()
    c.update_and_fetch(*kvs(seed, n))
    return c


def _kv(n: int) -> Any:
    c = mc.KVCache()
    if n:
        c.update_and_fetch(*kvs(1, n))
    return c


def _trimmed() -> Any:
    c = _kv(300)
    c.trim(20)
    return c


def _concat() -> Any:
    c = mc.ConcatenateKVCache()
    c.update_and_fetch(*kvs(2, 9))
    return c


def _rotating(steps: list[int], keep: int) -> Callable[[], Any]:
    def build() -> Any:
        c = mc.RotatingKVCache(max_size=16, keep=keep)
        for i, s in enumerate(steps):
            c.update_and_fetch(*kvs(10 + i, s))
        return c

    return build


def _quantized() -> Any:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(3, 40, d=64))
    return c.to_quantized(group_size=64, bits=4)


def _chunked() -> Any:
    c = mc.ChunkedKVCache(chunk_size=16)
    for i, s in enumerate([10, 12, 9]):
        c.maybe_trim_front()
        c.update_and_fetch(*kvs(20 + i, s))
    return c


def _arrays() -> Any:
    a = mc.ArraysCache(3, left_padding=[2, 0])
    a[1] = arr(30, (2, 3, 5), mx.float32)
    a.lengths = mx.array([4, 6])
    return a


def _cache_list() -> Any:
    a = mc.ArraysCache(2)
    a[0] = arr(31, (1, 3, 4), mx.float32)
    return mc.CacheList(mc.CacheList(_kv(21), a), _rotating([20, 1], 0)())


def _batch_kv() -> Any:
    c = mc.BatchKVCache(left_padding=[3, 0])
    c.update_and_fetch(*kvs(40, 6, b=2))
    return c


def _batch_rotating() -> Any:
    c = mc.BatchRotatingKVCache(max_size=8, left_padding=[2, 0])
    c.update_and_fetch(*kvs(41, 5, b=2))
    for i in range(7):
        c.update_and_fetch(*kvs(50 + i, 1, b=2))
    return c


def _delayed(n: int) -> Callable[[], Any]:
    def build() -> Any:
        from persist.caches import DelayedQuantizedKVCache

        c = DelayedQuantizedKVCache(start=32, bits=4, group_size=64)
        for i, s in enumerate([n - 1, 1] if n <= 32 else [32, n - 32]):
            c.update_and_fetch(*kvs(60 + i, s, d=64))
        return c

    return build


def _gated_delta() -> Any:
    from persist.caches import GatedDeltaCache

    c = GatedDeltaCache()
    c[0] = arr(70, (1, 3, 24), mx.float32)
    c[1] = arr(71, (1, 2, 8, 8), mx.float32)
    c.advance(17)
    return c


def _deepseek_v4() -> Any:
    """Every shape the layer cache takes: a field that is None, fields of zero rows."""
    from mlx_lm.models.deepseek_v41 import LayerCache

    c = LayerCache(window_size=8)
    c.update_window(arr(80, (1, 12, 32), mx.float32))
    c.compress_kv = arr(81, (1, 3, 32), mx.float32)
    c.pending_kv = arr(82, (1, 0, 32), mx.float32)
    c.pending_gate = arr(83, (1, 0, 32), mx.float32)
    return c


CASES: dict[str, Callable[[], Any]] = {
    "kv-empty": lambda: _kv(0),
    "kv-10": lambda: _kv(10),
    "kv-trimmed": _trimmed,
    "concat-kv": _concat,
    "rotating-unwrapped": _rotating([5, 1, 1], 0),
    "rotating-wrapped-keep": _rotating([3] + [1] * 30, 4),
    "rotating-big-prefill": _rotating([50], 2),
    "quantized-kv": _quantized,
    "chunked-kv": _chunked,
    "arrays": _arrays,
    "cache-list": _cache_list,
    "batch-kv": _batch_kv,
    "batch-rotating-kv": _batch_rotating,
    "delayed-quantized-before": _delayed(20),
    "delayed-quantized-after": _delayed(40),
    "gated-delta": _gated_delta,
    "deepseek-v4-layer": _deepseek_v4,
}

IDENTITY = ModelIdentity(
    model_type="golden",
    config="c" * 64,
    weights="w" * 32,
    tokenizer="t" * 64,
    chat_template="h" * 64,
    cache_config=(("max_kv_size", 16),),
    name="golden",
)


def probe(cache: Any) -> str:
    """Hash what the cache returns for fixed updates (or holds, for state slots)."""
    h = xxhash.xxh3_128()

    def put(x: Any) -> None:
        if isinstance(x, (tuple, list)):
            for y in x:
                put(y)
        elif isinstance(x, mx.array):
            x = mx.contiguous(x) if x.ndim else x.reshape(1)
            mx.eval(x)
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(bytes(memoryview(x)))
        else:
            h.update(repr(x).encode())

    def visit(c: Any) -> None:
        if isinstance(c, mc.CacheList):
            for inner in c.caches:
                visit(inner)
        elif isinstance(c, mc.ArraysCache):
            put(c.cache)
            put([c.left_padding, c.lengths])
            if hasattr(c, "offsets"):  # GatedDeltaCache
                put(c.offsets)
        elif hasattr(c, "inner"):  # a wrapper of persist's own: its settings, then its cache
            put([c.start, c.quant_bits, c.quant_group_size, c.converted_at])
            visit(c.inner)
        elif type(c).__name__ == "LayerCache":  # DeepSeek-V4: fields, then a window update
            put([c.window_size, c.offset, [a is None for a in c.state]])
            put([a for a in c.state if a is not None])
            put(c.update_window(arr(93, (1, 2, 32), mx.float32)))
        elif isinstance(c, mc.QuantizedKVCache):
            put([c.offset, c.bits, c.group_size, c.keys_and_values()])
        else:
            rows = c.offset.shape[0] if isinstance(c.offset, mx.array) else 1
            d = D if c.keys is None else c.keys.shape[-1]
            put(c.update_and_fetch(*kvs(90, 1, b=rows, d=d)))
            put(c.update_and_fetch(*kvs(92, 3, b=rows, d=d)))

    visit(cache)
    return h.hexdigest()
