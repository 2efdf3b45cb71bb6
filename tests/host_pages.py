"""The host tier's page pool without a GPU: pages of plain host memory, and pack/unpack
as memmoves, through the same ``PagePool`` and ``PagedHolder`` the CUDA tier uses
(as ``HostLane`` stands in for the copy engine in tests/engine/test_staging.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from persist.cuda.pinned_pool import Page, PagedHolder, PagePool, Part
from persist.engine.host.records import arrays_of
from persist.engine.host.tier import HostTier

WHERE = "host memory pages"


class HostChunks:
    """An allocator of zeroed host chunks, (address, address), that counts its calls."""

    def __init__(self, refuse_after: int | None = None) -> None:
        self.chunks: dict[int, np.ndarray] = {}
        self.made = self.freed = 0
        self.refuse_after = refuse_after  # chunks, then MemoryError (pinned memory refused)

    def alloc(self, n: int) -> tuple[int, int]:
        if self.refuse_after is not None and len(self.chunks) >= self.refuse_after:
            raise MemoryError(f"no {n} bytes")
        buf = np.zeros(n, dtype=np.uint8)
        addr = int(buf.ctypes.data)
        self.chunks[addr] = buf
        self.made += 1
        return addr, addr

    def free(self, addr: int) -> None:
        del self.chunks[addr]
        self.freed += 1

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.chunks.values())


def spans(offset: int, n: int, pages: Sequence[Page], page: int) -> Iterator[tuple[int, int, int]]:
    """(host address in a page, byte of the array, length) for bytes [offset, offset + n)."""
    done = 0
    while done < n:
        p, within = divmod(offset + done, page)
        k = min(n - done, page - within)
        yield pages[p].host + within, done, k
        done += k


def raw_bytes(a: mx.array) -> np.ndarray:
    """``a``'s bytes in row order (a strided array is made contiguous first)."""
    flat = mx.contiguous(a.reshape(-1)).view(mx.uint8)
    mx.eval(flat)
    return np.frombuffer(memoryview(flat), dtype=np.uint8)


def pack(items: list[tuple[mx.array, int]], pages: Sequence[Page], page: int) -> None:
    for a, offset in items:
        src = raw_bytes(a)
        assert src.nbytes == a.nbytes
        for dst, at, k in spans(offset, src.nbytes, pages, page):
            ctypes.memmove(dst, src.ctypes.data + at, k)


def unpack(parts: list[Part], pages: Sequence[Page], page: int) -> list[mx.array]:
    out = []
    for p in parts:
        buf = np.empty(p.nbytes, dtype=np.uint8)
        for src, at, k in spans(p.offset, p.nbytes, pages, page):
            ctypes.memmove(buf.ctypes.data + at, src, k)
        out.append(mx.array(buf).view(p.dtype).reshape(p.shape))  # a copy: MLX's own buffer
    mx.eval(out)
    return out


def host_holder(
    budget: int,
    *,
    page_bytes: int = 4096,
    chunk_bytes: int = 16 * 4096,
    chunks: HostChunks | None = None,
) -> PagedHolder:
    """A holder of ``budget`` bytes of host pages (small ones: tiny models' entries span many)."""
    c = chunks if chunks is not None else HostChunks()
    pool = PagePool(budget, c.alloc, c.free, page_bytes=page_bytes, chunk_bytes=chunk_bytes)
    return PagedHolder(pool, pack, unpack, WHERE)


def holds_no_array(tier: HostTier) -> bool:
    """Every entry's arrays are in pages: the tier keeps no buffer of MLX's."""
    return all(not arrays_of(k.records) for k in tier._entries.values())


def pages_in_use(tier: HostTier) -> int:
    assert tier.holder is not None
    pool = tier.holder.pool  # type: ignore[attr-defined]
    return int(pool.used_pages * pool.page_bytes)


DTYPES = [mx.uint8, mx.bfloat16, mx.float16, mx.float32, mx.uint32, mx.int64, mx.bool_]


def sample(n: int, dtype: Any, seed: int) -> mx.array:
    """``n`` elements of any bit pattern (NaN payloads and -0.0 included)."""
    raw = np.random.default_rng(seed).integers(0, 256, n * dtype.size, dtype=np.uint8)
    if dtype == mx.bool_:
        raw &= 1
    return mx.array(raw).view(dtype)


def odd_arrays(dtype: Any, page: int) -> list[mx.array]:
    """Arrays a page layout gets wrong first: odd sizes, one, two pages and a bit, an
    empty one, a KV cache's live slice (rows a buffer's row apart), rows of a
    matrix, an offset (unaligned when ``dtype`` is a byte); evaluated."""
    n = page // dtype.size
    sizes = [1, 15, 16, 17, 4097 // dtype.size + 1, n + 3, 2 * n + 5, 0]
    arrays = [sample(k, dtype, seed) for seed, k in enumerate(sizes)]
    arrays.append(sample(2 * 3 * 40 * 8, dtype, 7).reshape(2, 3, 40, 8)[..., :29, :])
    arrays.append(sample(600, dtype, 9).reshape(20, 30)[:, 3:17])
    arrays.append(sample(4099, dtype, 10)[1:])
    mx.eval(arrays)
    return arrays


def given_back_exactly(holder: PagedHolder, arrays: list[mx.array]) -> Any:
    """Hold ``arrays``, give them back, assert every one bit for bit; the Held."""
    want = [raw_bytes(a).copy() for a in arrays]
    held = holder.hold(arrays)
    got = holder.give(held)
    for a, b, w in zip(arrays, got, want, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape
        assert np.array_equal(raw_bytes(b), w)
    return held
