"""The synthetic caches the throughput benchmarks save and restore, shaped like
real models' (random values: the bytes' layout is what is timed), and the one
decode step a restore is followed by.  bench_throughput, its default-path child
process and the CUDA probes all build these, so they live below all of them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

import persist

IDENTITY = persist.ModelIdentity("bench", "c", "w", "t", "h", name="bench")


def llama(tokens: int, seed: int = 0) -> list[Any]:
    """Llama-3-8B's cache shape: 32 layers, 8 KV heads, head dim 128, bfloat16
    (``seed``: another cache of the same shape, no block shared with seed 0's)."""
    return [_kv(tokens, 8, 128, i + 1000 * seed) for i in range(32)]


def qwen3_next(tokens: int) -> list[Any]:
    """Qwen3-Next-80B-A3B's shape: 48 layers, every 4th full attention (2 KV heads of
    256), the rest gated-DeltaNet state (conv 3 x 8192 bf16, recurrent 32 x 128 x 128 f32)."""
    out: list[Any] = []
    for i in range(48):
        if i % 4 == 3:
            out.append(_kv(tokens, 2, 256, i))
        else:
            c = ArraysCache(2)
            key = mx.random.key(i)
            c[0] = mx.random.normal((1, 3, 8192), key=key).astype(mx.bfloat16)
            c[1] = mx.random.normal((1, 32, 128, 128), key=key)
            out.append(c)
    mx.eval([c.state for c in out])
    return out


def _kv(tokens: int, heads: int, dim: int, seed: int) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed)).astype(mx.bfloat16)
    c.update_and_fetch(k, k * 0.5)
    mx.eval(c.keys, c.values)
    return c


def first_step(cache: list[Any]) -> None:
    """What one decode step does to a cache: append one position to every attention layer."""
    for c in cache:
        if isinstance(c, KVCache):
            _, h, _, d = c.keys.shape
            one = mx.zeros((1, h, 1, d), dtype=c.keys.dtype)
            c.update_and_fetch(one, one)
    mx.eval([c.state for c in cache])
