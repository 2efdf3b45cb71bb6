"""Contract tests: fail loudly if mlx-lm's cache classes change shape.

persist's codecs read and set these attributes directly.  mlx-lm changed its
``state`` tuples between 0.32.0 and 0.32.2; if a release in the pinned range
changes them again, these tests say exactly what moved.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mc


def kv(n: int, b: int = 1) -> tuple[mx.array, mx.array]:
    k = mx.zeros((b, 2, n, 8))
    return k, k


def filled(cls: type, *args: object) -> object:
    c = cls(*args)
    c.update_and_fetch(*kv(3))
    return c


CASES = [
    (filled(mc.KVCache), 3, {"keys", "values", "offset"}),
    (filled(mc.ConcatenateKVCache), 2, {"keys", "values", "offset"}),
    (filled(mc.RotatingKVCache, 8, 2), 6, {"keys", "values", "offset", "keep", "max_size", "_idx"}),
    (filled(mc.ChunkedKVCache, 8), 5, {"keys", "values", "offset", "chunk_size", "start_position"}),
    (mc.KVCache().to_quantized(), 5, {"keys", "values", "offset", "group_size", "bits"}),
    (mc.ArraysCache(2), 3, {"cache", "left_padding", "lengths"}),
    (mc.CacheList(mc.KVCache()), 1, {"caches"}),
]


@pytest.mark.parametrize("cache,n_state,attrs", CASES, ids=lambda x: type(x).__name__)
def test_serial_cache_shape(cache: object, n_state: int, attrs: set[str]) -> None:
    assert len(cache.state) == n_state, f"{type(cache).__name__}.state changed length"
    missing = attrs - set(vars(cache))
    assert not missing, f"{type(cache).__name__} lost attributes {missing}"


def test_batch_cache_shapes() -> None:
    b = mc.BatchKVCache(left_padding=[1, 0])
    b.update_and_fetch(*kv(3, 2))
    assert len(b.state) == 5
    assert {"keys", "values", "offset", "left_padding", "_idx", "_right_padding"} <= set(vars(b))
    r = mc.BatchRotatingKVCache(8, left_padding=[1, 0])
    r.update_and_fetch(*kv(3, 2))
    assert len(r.state) == 8
    assert {
        "keys",
        "values",
        "offset",
        "left_padding",
        "max_size",
        "_offset",
        "_idx",
        "rotated",
        "_lengths",
    } <= set(vars(r))


def test_step_sizes_and_extract() -> None:
    for cls in (mc.KVCache, mc.RotatingKVCache, mc.QuantizedKVCache, mc.ChunkedKVCache):
        assert cls.step == 256
    b = mc.BatchKVCache(left_padding=[2, 0])
    b.update_and_fetch(*kv(4, 2))
    row = b.extract(0)
    assert type(row) is mc.KVCache and row.offset == 2
