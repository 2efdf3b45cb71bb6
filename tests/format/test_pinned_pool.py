"""The host tier's page pool (cuda/pinned_pool): lazy chunks under a budget, fixed
pages reused in any order, clean failures; and the holder's layout, bit for bit,
through host pages and memmoves (tests/host_pages.py)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.cuda.pinned_pool import PagedHolder, PagePool
from persist.errors import HostCacheFullError, InvalidArgumentError, InvalidStateError
from tests.host_pages import DTYPES, HostChunks, host_holder, raw_bytes, sample

PAGE = 4096


def pool(budget: int, chunk_pages: int = 4, chunks: HostChunks | None = None) -> PagePool:
    c = chunks if chunks is not None else HostChunks()
    return PagePool(budget, c.alloc, c.free, page_bytes=PAGE, chunk_bytes=chunk_pages * PAGE)


def test_pages_come_from_lazy_chunks_within_the_budget() -> None:
    chunks = HostChunks()
    p = pool(10 * PAGE + 100, chunks=chunks)  # 10 pages: chunks of 4, 4, then 2
    assert chunks.made == 0 and p.pinned_pages == 0  # nothing pinned before a need
    one = p.allocate(1)
    assert len(one) == 1 and chunks.made == 1 and p.pinned_pages == 4
    two = p.allocate(PAGE + 1)
    assert len(two) == 2 and chunks.made == 1
    rest = p.allocate(7 * PAGE)
    assert len(rest) == 7 and chunks.made == 3 and chunks.nbytes == 10 * PAGE
    pages = [*one, *two, *rest]
    assert len({pg.host for pg in pages}) == 10
    assert all(pg.host == pg.device for pg in pages)  # host memory: one address
    with pytest.raises(HostCacheFullError):
        p.allocate(1)  # the budget's pages are all taken: the tier evicts first
    assert chunks.made == 3  # a failed allocation pins nothing


def test_reserve_pins_the_budget_up_front_and_allocations_pin_nothing_after() -> None:
    chunks = HostChunks()
    p = pool(10 * PAGE + 100, chunks=chunks)
    assert p.reserve() == 10 * PAGE  # chunks of 4, 4, then 2: the budget, no more
    assert chunks.made == 3 and p.pinned_pages == 10 and p.used_pages == 0
    assert p.reserve() == 10 * PAGE and chunks.made == 3  # again: nothing more
    taken = [p.allocate(3 * PAGE), p.allocate(7 * PAGE)]
    assert chunks.made == 3  # served from what was pinned: no driver call beside a request
    for t in taken:
        p.free(t)


def test_reserve_stops_quietly_where_memory_is_refused() -> None:
    chunks = HostChunks(refuse_after=2)
    p = pool(16 * PAGE, chunks=chunks)
    assert p.reserve() == 8 * PAGE  # two chunks, then the system refused: no error
    held = p.allocate(8 * PAGE)
    with pytest.raises(HostCacheFullError):
        p.allocate(PAGE)  # the rest is asked for on need, and refused again
    chunks.refuse_after = None
    assert len(p.allocate(PAGE)) == 1 and chunks.made == 3  # pinned on need once it can be
    p.free(held)


def test_freed_pages_are_reused_without_pinning_more() -> None:
    chunks = HostChunks()
    p = pool(8 * PAGE, chunks=chunks)
    a, b, c = p.allocate(3 * PAGE), p.allocate(2 * PAGE), p.allocate(3 * PAGE)
    p.free(a)
    p.free(c)  # 6 pages free, in two runs that are not next to each other
    big = p.allocate(6 * PAGE)  # fixed pages: no fragmentation
    assert {pg.host for pg in big} == {pg.host for pg in [*a, *c]}
    assert chunks.made == 2 and p.used_pages == 8
    p.free(b)
    p.free(big)
    assert p.used_pages == 0 and p.pinned_pages == 8


def test_bad_frees_and_sizes_are_typed() -> None:
    p = pool(8 * PAGE)
    a = p.allocate(PAGE)
    p.free(a)
    with pytest.raises(InvalidStateError):
        p.free(a)  # twice
    other = pool(8 * PAGE).allocate(PAGE)
    with pytest.raises(InvalidStateError):
        p.free(other)  # another pool's
    b = p.allocate(PAGE)
    with pytest.raises(InvalidStateError):
        p.free([*b, *b])
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            p.allocate(bad)  # type: ignore[arg-type]
    chunks = HostChunks()
    for kw in ({"budget": -1}, {"page_bytes": 10}, {"page_bytes": 0}, {"chunk_bytes": PAGE + 16}):
        args: dict[str, Any] = {"budget": PAGE, "page_bytes": PAGE, "chunk_bytes": 4 * PAGE, **kw}
        with pytest.raises(InvalidArgumentError):
            PagePool(args.pop("budget"), chunks.alloc, chunks.free, **args)


def test_refused_memory_fails_cleanly_and_trim_gives_chunks_back() -> None:
    chunks = HostChunks(refuse_after=1)
    p = pool(16 * PAGE, chunks=chunks)
    a = p.allocate(4 * PAGE)
    with pytest.raises(HostCacheFullError):
        p.allocate(PAGE)  # the system refused a second chunk
    p.trim()
    assert chunks.freed == 0  # pages in use: nothing given back
    p.free(a)
    p.trim()
    assert chunks.freed == 1 and not chunks.chunks and p.pinned_pages == 0
    chunks.refuse_after = None
    assert len(p.allocate(5 * PAGE)) == 5  # pinned again on need


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9 * PAGE)), max_size=40))
def test_any_sequence_keeps_the_books(ops: list[tuple[bool, int]]) -> None:
    chunks = HostChunks()
    max_pages = 12
    p = pool(max_pages * PAGE + 7, chunk_pages=5, chunks=chunks)
    live: list[list[Any]] = []
    for free_one, n in ops:
        if free_one and live:
            p.free(live.pop(n % len(live)))
            continue
        need = max(1, -(-n // PAGE))
        used = sum(len(x) for x in live)
        if used + need > max_pages:
            with pytest.raises(HostCacheFullError):
                p.allocate(n)
        else:  # fits whatever the order of earlier frees: pages are interchangeable
            live.append(p.allocate(n))
            assert len(live[-1]) == need
        held = [pg.host for x in live for pg in x]
        assert len(held) == len(set(held)) == p.used_pages  # no page lent twice
        assert p.pinned_pages <= max_pages and chunks.nbytes == p.pinned_pages * PAGE
        assert chunks.made <= -(-max_pages // 5)  # chunks only when no page was free
        assert all(any(c <= h < c + 5 * PAGE for c in chunks.chunks) for h in held)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_holder_gives_back_every_bit(dtype: Any) -> None:
    holder = host_holder(64 * PAGE)
    sizes = [1, 15, 16, 17, 4097 // dtype.size + 1, 3 * PAGE // dtype.size + 5, 0]
    arrays = [sample(n, dtype, seed) for seed, n in enumerate(sizes)]
    arrays.append(sample(600, dtype, 9).reshape(20, 30)[:, 3:17])  # strided
    held = holder.hold(arrays)
    assert holder.pool.used_pages * PAGE == holder.footprint([int(a.nbytes) for a in arrays])
    assert [p.offset % 16 for p in held.parts] == [0] * len(arrays)
    got = holder.give(held)
    for a, b in zip(arrays, got, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(raw_bytes(b), raw_bytes(a))
    again = holder.give(held)  # a fetch does not consume the entry
    assert all(np.array_equal(raw_bytes(a), raw_bytes(b)) for a, b in zip(got, again, strict=True))
    holder.release(held)
    assert holder.pool.used_pages == 0


def test_a_failed_pack_frees_its_pages() -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("kernel failed")

    ok = host_holder(8 * PAGE)
    holder = PagedHolder(ok.pool, broken, lambda *_: [], "x")
    with pytest.raises(RuntimeError):
        holder.hold([sample(100, mx.float32, 1)])
    assert holder.pool.used_pages == 0
    with pytest.raises(HostCacheFullError):
        holder.hold([sample(9 * PAGE, mx.uint8, 2)])  # more than the budget's pages
