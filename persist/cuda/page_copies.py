"""The host tier's copies by the copy engine instead of a kernel (issue 39).

The tier's pack and unpack kernels (``cuda.kernels``) move a cache over PCIe
with threads of the GPU: a 1 GiB eviction occupied the device's cores for
tens of milliseconds beside the next request's prefill, and a strided KV
slice was first copied whole into new device memory to be a kernel input.
Here each row of an array goes to (or comes from) the pinned pages with the
driver's asynchronous copies on a stream of the tier's own, which run on the
copy engine: no device core, no device memory beyond the fetched arrays.
A layout these copies do not handle (``addressing.rows`` refuses it, or it would
take too many calls) goes through the kernels, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from .addressing import address, rows

if TYPE_CHECKING:
    from .driver import Driver

# pinned_pool's Page (host, device) and Part (offset, nbytes, shape, dtype); not
# imported: pinned_pool imports this module
Page = Any
Part = Any

__all__ = ["EngineCopies", "row_segments", "MAX_CALLS"]

# driver calls one array may take (about 2 us each); past it, a kernel is cheaper
MAX_CALLS = 8192

Segment = tuple[int, int, int, int]  # array byte offset, page index, byte within page, bytes


def row_segments(width: int, height: int, pitch: int, offset: int, page: int) -> Iterator[Segment]:
    """``height`` rows of ``width`` bytes, ``pitch`` apart in the array, laid back to
    back from byte ``offset`` of pages of ``page`` bytes: the pieces no page
    boundary cuts, as (byte in the array, page, byte in that page, bytes)."""
    for r in range(height):
        src, at, left = r * pitch, offset + r * width, width
        while left:
            index, within = divmod(at, page)
            n = min(left, page - within)
            yield src, index, within, n
            src, at, left = src + n, at + n, left - n


def calls(width: int, height: int, nbytes: int, page: int) -> int:
    """An upper bound on ``row_segments``' pieces."""
    return height + nbytes // page + 1 if width else 0


class EngineCopies:
    """``Pack`` and ``Unpack`` (``pinned_pool``) on the copy engine, each direction on
    a stream of its own (a keep and a fetch may run at once, on two threads)."""

    def __init__(self, driver: Driver, pack: Callable[..., None], unpack: Callable[..., Any]):
        self.driver = driver
        self._kernel_pack, self._kernel_unpack = pack, unpack
        self._out, self._in = driver.stream(), driver.stream()
        self._out_lock, self._in_lock = threading.Lock(), threading.Lock()

    def pack(self, items: list[tuple[mx.array, int]], pages: Sequence[Page], b: int) -> None:
        mx.eval([a for a, _ in items])  # evaluated on the thread that made them: no wait
        rest: list[tuple[mx.array, int]] = []
        d = self.driver
        with self._out_lock:
            d.make_current()
            for a, offset in items:
                try:
                    start, width, height, pitch = rows(a)
                except ValueError:
                    rest.append((a, offset))
                    continue
                if calls(width, height, a.nbytes, b) > MAX_CALLS:
                    rest.append((a, offset))
                    continue
                for src, i, within, n in row_segments(width, height, pitch, offset, b):
                    d.copy_out_async(start + src, pages[i].host + within, n, self._out)
            d.wait_stream(self._out)  # the arrays are read before they may be freed
        if rest:
            self._kernel_pack(rest, pages, b)

    def unpack(self, parts: list[Part], pages: Sequence[Page], b: int) -> list[mx.array]:
        # fresh device buffers filled by MLX's own kernels (never managed memory),
        # done before the copies land in them
        outs = [mx.zeros(p.shape, dtype=p.dtype) for p in parts]
        mx.eval(outs)
        mx.synchronize()
        try:
            starts = [address(o) for o in outs]
        except ValueError:  # not row-contiguous: the kernels make their own outputs
            return list(self._kernel_unpack(parts, pages, b))
        d = self.driver
        with self._in_lock:
            d.make_current()
            for p, start in zip(parts, starts, strict=True):
                for at, i, within, n in row_segments(p.nbytes, 1, p.nbytes, p.offset, b):
                    d.copy_in(pages[i].host + within, start + at, n, self._in)
            d.wait_stream(self._in)  # landed before MLX reads them
        return outs
