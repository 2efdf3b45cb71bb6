"""Codec round trips on synthetic caches: every kind, every awkward state.

Law: decode(encode(c)) continues exactly like c.  Each test feeds the
original and the restored cache the same updates and compares what attention
would see (the fetched keys/values, the mask) bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mc

import persist
from tests.helpers import assert_same_state, live_state, raw

H, D = 2, 8


def kv(n: int, seed: int, d: int = D, dtype: Any = mx.bfloat16) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((1, H, n, d), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, H, n, d), key=mx.random.key(seed + 1)).astype(dtype)
    return k, v


def roundtrip(tmp: Path, caches: list[Any], name: str = "c") -> list[Any]:
    path = tmp / f"{name}.safetensors"
    persist.save_file(path, caches)
    return persist.load_file(path).cache


def same(a: Any, b: Any) -> None:
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    elif isinstance(a, mx.array):
        assert a.shape == b.shape and a.dtype == b.dtype and raw(a) == raw(b)
    else:
        assert a == b


def feed(orig: Any, restored: Any, steps: list[int], seed: int, d: int = D) -> None:
    """Apply the same updates to both caches; compare every fetched result."""
    for i, s in enumerate(steps):
        k, v = kv(s, seed + 10 * i, d)
        same(orig.update_and_fetch(k, v), restored.update_and_fetch(k, v))
        if hasattr(orig, "make_mask"):
            for n in (1, 3):
                same(
                    orig.make_mask(n, window_size=None, return_array=True),
                    restored.make_mask(n, window_size=None, return_array=True),
                )


@pytest.mark.parametrize("n", [1, 10, 255, 256, 257, 600])
def test_kv_roundtrip_and_step_capacity(n: int, tmp_path: Path) -> None:
    c = mc.KVCache()
    c.update_and_fetch(*kv(n, 1))
    (r,) = roundtrip(tmp_path, [c])
    # room for the next step: a restore is followed by a decode step, which then
    # writes in place instead of copying the cache to grow it
    assert r.offset == n and r.keys.shape[2] == (n + 1 + 255) // 256 * 256
    assert_same_state(live_state([c]), live_state([r]))
    feed(c, r, [1, 1, 5, 300], 7)


def test_kv_trimmed_tokens_are_never_written(tmp_path: Path) -> None:
    c = mc.KVCache()
    k, v = kv(40, 3, dtype=mx.float32)
    c.update_and_fetch(k, v)
    c.trim(15)
    path = tmp_path / "t.safetensors"
    persist.save_file(path, [c])
    data = path.read_bytes()
    gone = raw(k[:, :, 30:, :][0, 0])  # a trimmed position's bytes
    kept = raw(k[:, :, :25, :][0, 0])
    assert kept in data and gone not in data
    (r,) = persist.load_file(path).cache
    feed(c, r, [1, 4], 9)


def test_concat_kv_roundtrip(tmp_path: Path) -> None:
    c = mc.ConcatenateKVCache()
    c.update_and_fetch(*kv(33, 1))
    (r,) = roundtrip(tmp_path, [c])
    assert persist.kind_of(r) == "concat-kv"
    feed(c, r, [1, 2, 7], 3)


@st.composite
def ring_histories(draw: Any) -> tuple[int, int, list[int]]:
    max_size = draw(st.sampled_from([4, 8, 16, 33]))
    keep = draw(st.sampled_from([0, 0, 1, 4]))
    keep = min(keep, max_size - 1)
    steps = draw(st.lists(st.sampled_from([1, 1, 1, 2, 3, 7, 20, 50]), min_size=1, max_size=12))
    return max_size, keep, steps


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    hist=ring_histories(),
    after=st.lists(st.sampled_from([1, 1, 2, 9]), min_size=1, max_size=5),
)
def test_rotating_roundtrip_any_history(hist: Any, after: list[int], tmp_path: Path) -> None:
    """Before and after the ring wraps, with and without keep, by decode and by prefill."""
    max_size, keep, steps = hist
    c = mc.RotatingKVCache(max_size=max_size, keep=keep)
    for i, s in enumerate(steps):
        c.update_and_fetch(*kv(s, 100 + i))
    (r,) = roundtrip(tmp_path, [c])
    assert r.offset == c.offset and r.is_trimmable() == c.is_trimmable()
    assert r.keys.shape[2] <= max(max_size, 256)
    feed(c, r, after, 55)


def test_rotating_window_mask_after_wrap(tmp_path: Path) -> None:
    c = mc.RotatingKVCache(max_size=16, keep=0)
    for i in range(40):
        c.update_and_fetch(*kv(1, i))
    (r,) = roundtrip(tmp_path, [c])
    for _ in range(3):
        same(c.make_mask(1, window_size=8), r.make_mask(1, window_size=8))
        k, v = kv(1, 99)
        same(c.update_and_fetch(k, v), r.update_and_fetch(k, v))


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantized_kv_roundtrip(bits: int, group: int, tmp_path: Path) -> None:
    base = mc.KVCache()
    base.update_and_fetch(*kv(70, bits * group, d=128))
    c = base.to_quantized(group_size=group, bits=bits)
    (r,) = roundtrip(tmp_path, [c])
    assert (r.bits, r.group_size, r.offset) == (bits, group, 70)
    assert_same_state(live_state([c]), live_state([r]))
    # Continue inside the allocated step (mlx-lm allocates 6-bit buffers wrongly)
    feed(c, r, [1, 3], 11, d=128)


def test_quantized_floor_is_recorded(tmp_path: Path) -> None:
    base = mc.KVCache()
    base.update_and_fetch(*kv(50, 1, d=64))
    c = base.to_quantized(group_size=64, bits=4)
    (r,) = roundtrip(tmp_path, [c])
    assert persist.codecs.snapshot.snapshot_facts([r])[0].min_resume_offset == 50
    r.update_and_fetch(*kv(5, 2, d=64))
    assert persist.codecs.snapshot.snapshot_facts([r])[0].min_resume_offset == 50


def test_chunked_kv_roundtrip_after_front_trim(tmp_path: Path) -> None:
    c = mc.ChunkedKVCache(chunk_size=16)
    for i, s in enumerate([10, 12, 9]):
        c.maybe_trim_front()
        c.update_and_fetch(*kv(s, i))
    assert c.start_position > 0
    (r,) = roundtrip(tmp_path, [c])
    assert (r.start_position, r.offset) == (c.start_position, c.offset)
    for i, s in enumerate([1, 20]):
        c.maybe_trim_front()
        r.maybe_trim_front()
        k, v = kv(s, 50 + i)
        same(c.update_and_fetch(k, v), r.update_and_fetch(k, v))


def test_arrays_none_slots_padding_and_lengths(tmp_path: Path) -> None:
    a = mc.ArraysCache(3, left_padding=[2, 0])
    a[1] = mx.random.normal((2, 3, 5))
    a.lengths = mx.array([4, 6])
    (r,) = roundtrip(tmp_path, [a])
    assert r.cache[0] is None and r.cache[2] is None
    same(r.cache[1], a.cache[1])
    same(r.left_padding, a.left_padding)
    same(r.lengths, a.lengths)
    same(r.make_mask(6), a.make_mask(6))
    empty = mc.ArraysCache(2)
    (e,) = roundtrip(tmp_path, [empty], "e")
    assert e.cache == [None, None] and e.left_padding is None and e.lengths is None


def test_nested_cache_list_roundtrip(tmp_path: Path) -> None:
    inner = mc.CacheList(mc.KVCache(), mc.ArraysCache(2))
    outer = mc.CacheList(inner, mc.RotatingKVCache(max_size=8))
    inner.caches[0].update_and_fetch(*kv(20, 1))
    inner.caches[1][0] = mx.ones((1, 4))
    outer.caches[1].update_and_fetch(*kv(20, 2))
    assert persist.kind_of(outer) == "cache-list(cache-list(kv,arrays),rotating-kv)"
    (r,) = roundtrip(tmp_path, [outer])
    assert persist.kind_of(r) == persist.kind_of(outer)
    assert_same_state(live_state([outer]), live_state([r]))
    k, v = kv(1, 5)
    same(outer.caches[1].update_and_fetch(k, v), r.caches[1].update_and_fetch(k, v))
    same(inner.caches[0].update_and_fetch(k, v), r.caches[0].caches[0].update_and_fetch(k, v))


def batch_kv(rows: list[int]) -> mc.BatchKVCache:
    pad = [max(rows) - n for n in rows]
    c = mc.BatchKVCache(left_padding=pad)
    k = mx.random.normal((len(rows), H, max(rows), D), key=mx.random.key(1))
    c.update_and_fetch(k, k * 2)
    return c


def test_batch_kv_whole_batch_and_rows(tmp_path: Path) -> None:
    c = batch_kv([5, 9, 2])
    (r,) = roundtrip(tmp_path, [c])
    same(r.offset, c.offset)
    same(r.left_padding, c.left_padding)
    k = mx.random.normal((3, H, 1, D), key=mx.random.key(2))
    same(c.update_and_fetch(k, k), r.update_and_fetch(k, k))
    same(c.make_mask(1, return_array=True), r.make_mask(1, return_array=True))
    for i, n in enumerate([5, 9, 2]):
        row = persist.extract_row([c], i)
        assert persist.kind_of(row[0]) == "kv" and row[0].offset == n + 1
        (back,) = roundtrip(tmp_path, row, f"row{i}")
        assert_same_state(live_state(row), live_state([back]))


def test_batch_rotating_roundtrip(tmp_path: Path) -> None:
    c = mc.BatchRotatingKVCache(max_size=8, left_padding=[3, 0])
    c.update_and_fetch(*(mx.random.normal((2, H, 6, D)),) * 2)
    for i in range(12):
        k = mx.random.normal((2, H, 1, D), key=mx.random.key(i))
        c.update_and_fetch(k, k)
    assert c.rotated
    (r,) = roundtrip(tmp_path, [c])
    for i in range(3):
        same(c.make_mask(1), r.make_mask(1))
        k = mx.random.normal((2, H, 1, D), key=mx.random.key(50 + i))
        same(c.update_and_fetch(k, k), r.update_and_fetch(k, k))
    row = persist.extract_row([c], 0)
    assert persist.kind_of(row[0]) == "rotating-kv"


def test_unfinalized_batch_padding_is_refused(tmp_path: Path) -> None:
    c = mc.BatchKVCache(left_padding=[0, 0])
    c.prepare(right_padding=[2, 0], lengths=[3, 5])
    c.update_and_fetch(*(mx.zeros((2, H, 5, D)),) * 2)
    with pytest.raises(persist.NotResumableError, match="finalize"):
        persist.save_file(tmp_path / "x.safetensors", [c])


def test_batch_with_tokens_needs_a_row(tmp_path: Path) -> None:
    c = batch_kv([4, 4])
    with pytest.raises(persist.NotResumableError, match="extract_row"):
        persist.save_file(tmp_path / "x.safetensors", [c], [1, 2, 3, 4])


def test_tokens_must_match_every_offset(tmp_path: Path) -> None:
    c = mc.KVCache()
    c.update_and_fetch(*kv(5, 1))
    with pytest.raises(persist.NotResumableError, match="5 positions but 4 tokens"):
        persist.save_file(tmp_path / "x.safetensors", [c], [1, 2, 3, 4])
    assert not (tmp_path / "x.safetensors").exists()
