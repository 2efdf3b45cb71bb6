"""Fixed pages of page-locked host memory, and entries of arrays kept in them.

The host-RAM tier on CUDA (``engine.host.tier``) keeps what it holds here
rather than as device arrays: a cache mlx-lm evicted is written by a kernel
into pages of page-locked, device-mapped host memory (``cuMemHostAlloc``) and
read back over PCIe into a fresh device array by another (``cuda_kernels``:
``pack``, ``unpack``), so the tier holds no device memory and a fetch never
leaves a restored cache in managed memory.

``PagePool`` pins memory lazily in chunks (64 MiB), never more than its
budget, and keeps it: pinning is slow, freeing and pinning again per entry
would cost more than the copy.  Chunks are split into fixed pages (2 MiB), so
any free page serves any entry: no fragmentation, whatever the order of
frees.  ``PagedHolder`` lays an entry's arrays out back to back (16-byte
aligned) over as many pages as they need, at most one page of slack an entry.
The copies are injected (``Pack``, ``Unpack``): CUDA kernels here, plain
memmoves in the CPU tests, which run the same pool and layout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from ..errors import HostCacheFullError, InvalidArgumentError, InvalidStateError, PersistError

__all__ = [
    "proven",
    "PAGE_BYTES",
    "CHUNK_BYTES",
    "Page",
    "Part",
    "Held",
    "Holder",
    "PagePool",
    "PagedHolder",
    "cuda_holder",
]

PAGE_BYTES = 2 << 20  # an entry wastes at most one page; a page table stays short
CHUNK_BYTES = 64 << 20  # one cuMemHostAlloc: few driver calls, little pinned ahead of need
ALIGN = 16  # a kernel's uint4 words: every array starts on one

Alloc = Callable[[int], tuple[int, int]]  # bytes -> (host address, device address)
Free = Callable[[int], None]  # a chunk's host address back to the system


@dataclass(frozen=True)
class Page:
    """One page: its host address, and the device's address of the same bytes."""

    host: int
    device: int


@dataclass(frozen=True)
class Part:
    """One array of an entry: ``nbytes`` at byte ``offset`` of the entry's pages."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: Any  # mx.Dtype


@dataclass(frozen=True)
class Held:
    """An entry kept in pages: its pages in order, and where each array lies in them."""

    pages: tuple[Page, ...]
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# the arrays with their offsets -> their bytes in the pages; done on return
Pack = Callable[[list[tuple[mx.array, int]], Sequence[Page], int], None]
# parts -> fresh arrays read from the pages, in buffers of their own; done on return
Unpack = Callable[[list[Part], Sequence[Page], int], list[mx.array]]


class Holder(Protocol):
    """Where a host tier keeps its entries' arrays instead of holding them."""

    where: str  # in words, for logs and stats: "pinned host memory"

    def footprint(self, sizes: Sequence[int]) -> int: ...

    def hold(self, arrays: Sequence[mx.array]) -> Held: ...

    def give(self, held: Held) -> list[mx.array]: ...

    def release(self, held: Held) -> None: ...

    def trim(self) -> None: ...

    def reserve(self) -> int: ...

    def pinned_bytes(self) -> int: ...


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PagePool:
    """Pages of ``page_bytes`` from chunks of ``alloc``, at most ``budget`` bytes of them.

    Thread-safe.  ``allocate`` raises HostCacheFullError when the budget's pages
    are taken or ``alloc`` refuses memory; the caller frees pages and asks again.
    """

    def __init__(
        self,
        budget: int,
        alloc: Alloc,
        free: Free | None = None,
        *,
        page_bytes: int = PAGE_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if type(budget) is not int or budget < 0:
            raise InvalidArgumentError(f"a page pool's budget is bytes, at least 0: {budget!r}")
        if type(page_bytes) is not int or page_bytes <= 0 or page_bytes % ALIGN:
            raise InvalidArgumentError(f"a page is a positive multiple of 16 bytes: {page_bytes!r}")
        if type(chunk_bytes) is not int or chunk_bytes <= 0 or chunk_bytes % page_bytes:
            raise InvalidArgumentError(f"a chunk is a whole number of pages: {chunk_bytes!r}")
        self.page_bytes, self.chunk_pages = page_bytes, chunk_bytes // page_bytes
        self.max_pages = budget // page_bytes
        self._alloc, self._release = alloc, free
        self._free: list[Page] = []  # a stack: the page freed last is reused first
        self._used: set[Page] = set()
        self._chunks: list[int] = []  # host addresses, for ``trim``
        self._lock = threading.Lock()

    def pages_for(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    @property
    def used_pages(self) -> int:
        return len(self._used)

    @property
    def pinned_pages(self) -> int:
        return len(self._used) + len(self._free)

    def allocate(self, nbytes: int) -> list[Page]:
        """Pages enough for ``nbytes`` (one at least), pinning a chunk if none is free."""
        if type(nbytes) is not int or nbytes < 0:
            raise InvalidArgumentError(f"an allocation is bytes, at least 0: {nbytes!r}")
        need = max(1, self.pages_for(nbytes))
        with self._lock:
            if len(self._used) + need > self.max_pages:
                raise HostCacheFullError(
                    f"{need} pages of {self.page_bytes} bytes do not fit: "
                    f"{len(self._used)} of {self.max_pages} are taken"
                )
            while len(self._free) < need:
                self._grow()
            taken = self._free[len(self._free) - need :]
            del self._free[len(self._free) - need :]
            self._used.update(taken)
            return taken

    def _grow(self) -> None:
        """Under the lock: pin one more chunk (the last one short, to stay in the budget)."""
        pages = min(self.chunk_pages, self.max_pages - self.pinned_pages)
        try:
            host, device = self._alloc(pages * self.page_bytes)
        except (MemoryError, OSError) as e:
            raise HostCacheFullError(f"pinned host memory refused: {e}") from e
        self._chunks.append(host)
        b = self.page_bytes
        # reversed: the stack hands the chunk's pages out in address order
        self._free += [Page(host + i * b, device + i * b) for i in reversed(range(pages))]

    def reserve(self) -> int:
        """Pin the whole budget now; the bytes pinned.  Pinning while requests run
        stalls them (issue 39, on an H100: a host tier growing beside the requests
        spent 1.85 s in ``cuMemHostAlloc`` and a miss cost 1.5x plain mlx-lm's), so
        ``persist serve`` pins before it answers, as vLLM pins its swap space.  Memory
        refused stops it quietly: what could not be pinned is tried again on demand."""
        with self._lock:
            while self.pinned_pages < self.max_pages:
                try:
                    self._grow()
                except HostCacheFullError:
                    break
            return self.pinned_pages * self.page_bytes

    def free(self, pages: Sequence[Page]) -> None:
        """Pages back to the pool (kept pinned); a page not allocated is an error."""
        with self._lock:
            if len(set(pages)) != len(pages) or not self._used.issuperset(pages):
                raise InvalidStateError("freeing pages this pool did not hand out")
            self._used.difference_update(pages)
            self._free += reversed(pages)

    def trim(self) -> None:
        """With no page in use, every chunk back to the system (the tier was cleared)."""
        with self._lock:
            if self._used or self._release is None:
                return
            for host in self._chunks:
                self._release(host)
            self._chunks.clear()
            self._free.clear()


class PagedHolder:
    """An entry's arrays, back to back in pool pages; ``pack``/``unpack`` move the bytes."""

    def __init__(self, pool: PagePool, pack: Pack, unpack: Unpack, where: str) -> None:
        self.pool, self._pack, self._unpack, self.where = pool, pack, unpack, where

    def footprint(self, sizes: Sequence[int]) -> int:
        """The bytes of pages an entry of arrays of these sizes takes."""
        total = sum(_aligned(n) for n in sizes)
        return max(1, self.pool.pages_for(total)) * self.pool.page_bytes

    def hold(self, arrays: Sequence[mx.array]) -> Held:
        """Every array's bytes in pages of the pool (HostCacheFullError: none free)."""
        parts, offset = [], 0
        for a in arrays:
            parts.append(Part(offset, int(a.nbytes), tuple(a.shape), a.dtype))
            offset += _aligned(int(a.nbytes))
        pages = self.pool.allocate(offset)
        try:
            items = [(a, p.offset) for a, p in zip(arrays, parts, strict=True) if p.nbytes]
            self._pack(items, pages, self.pool.page_bytes)
        except BaseException:
            self.pool.free(pages)
            raise
        return Held(tuple(pages), tuple(parts))

    def give(self, held: Held) -> list[mx.array]:
        """Fresh arrays of the entry, each in a buffer of its own (empty ones made here)."""
        full = [p for p in held.parts if p.nbytes]
        got = iter(self._unpack(full, held.pages, self.pool.page_bytes))
        return [next(got) if p.nbytes else mx.zeros(p.shape, dtype=p.dtype) for p in held.parts]

    def release(self, held: Held) -> None:
        self.pool.free(held.pages)

    def trim(self) -> None:
        self.pool.trim()

    def reserve(self) -> int:
        return self.pool.reserve()

    def pinned_bytes(self) -> int:
        return self.pool.pinned_pages * self.pool.page_bytes


def cuda_holder(
    budget: int, *, page_bytes: int = PAGE_BYTES, chunk_bytes: int = CHUNK_BYTES
) -> PagedHolder:
    """Pinned, device-mapped pages and the pack/unpack kernels, in MLX's CUDA context."""
    from . import pinned
    from .driver import Driver
    from .kernels import pack, unpack
    from .page_copies import EngineCopies

    driver = Driver()

    def alloc(n: int) -> tuple[int, int]:
        driver.make_current()  # the keeping thread may never have called the driver
        return driver.host_alloc(n)

    def free(host: int) -> None:
        driver.make_current()  # a Store's close may run on any thread
        driver.host_free(host)

    def pack_pages_by_kernel(
        items: list[tuple[mx.array, int]], pages: Sequence[Page], b: int
    ) -> None:
        pack(items, [p.device for p in pages], b)

    def unpack_pages_by_kernel(parts: list[Part], pages: Sequence[Page], b: int) -> list[mx.array]:
        specs = [(p.offset, p.nbytes, p.shape, p.dtype) for p in parts]
        return unpack(specs, [p.device for p in pages], b)

    pack_pages, unpack_pages = pack_pages_by_kernel, unpack_pages_by_kernel
    if pinned.direct():  # the copy engine, no kernel (cuda.page_copies)
        engine = EngineCopies(driver, pack_pages_by_kernel, unpack_pages_by_kernel)
        pack_pages, unpack_pages = engine.pack, engine.unpack

    pool = PagePool(budget, alloc, free, page_bytes=page_bytes, chunk_bytes=chunk_bytes)
    return PagedHolder(pool, pack_pages, unpack_pages, "pinned host memory")


def proven(holder: Holder, budget: int) -> str | None:
    """Do ``holder``'s pages give back bit for bit what they hold (odd sizes, several
    dtypes, and where ``budget`` has room, an array spanning pages)?  None if so,
    else why not.  Checked once per tier before any cache is kept there: a kernel
    that another MLX build compiles differently must cost speed, never a wrong cache."""
    sizes = [1, 15, 17, 4097]
    if budget >= 2 * PAGE_BYTES + (64 << 10):
        sizes.append(PAGE_BYTES + (1 << 20) + 5)
    rng = np.random.default_rng(0)
    arrays = [mx.array(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    arrays.append(mx.array(rng.standard_normal((3, 1000), dtype=np.float32)).astype(mx.bfloat16))
    # a KV cache's live slice of a larger buffer: rows a buffer's row apart
    arrays.append(mx.array(rng.standard_normal((1, 3, 40, 8), dtype=np.float32))[..., :29, :])
    mx.eval(arrays)
    try:
        held = holder.hold(arrays)
        try:
            got = holder.give(held)
            same = all(
                a.shape == b.shape
                and a.dtype == b.dtype
                and bool(mx.array_equal(_bits(a), _bits(b)))
                for a, b in zip(arrays, got, strict=True)
            )
        finally:
            holder.release(held)
            holder.trim()
    except HostCacheFullError as e:
        return f"no room for the check: {e}"
    except (OSError, MemoryError, RuntimeError, ValueError, PersistError) as e:
        return f"the check failed: {e}"
    return None if same else "they gave back other bytes than they held"


def _bits(a: mx.array) -> mx.array:
    return (
        a.view(mx.uint8)
        if a.dtype.size == 1
        else a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32)
    )
