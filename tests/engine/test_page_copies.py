"""The host tier's copy-engine pack and unpack (``cuda.page_copies``) without a GPU.

The driver's copies are memmoves here (an MLX CPU array's DLPack address is host
memory), so the row layout (``dlpack.rows``), the page segments and the fallback
to the kernels for other layouts run as on CUDA, bit for bit against the bytes;
tests/engine/test_host_tier_cuda.py runs the real copy engine on a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist.cuda.dlpack import rows
from persist.cuda.page_copies import EngineCopies, row_segments
from persist.cuda.pinned_pool import PagedHolder, PagePool, proven
from tests.helpers import ON_CUDA
from tests.host_pages import (
    DTYPES,
    HostChunks,
    given_back_exactly,
    odd_arrays,
    pack,
    raw_bytes,
    sample,
    unpack,
)

# stand-in drivers memmove host memory; on CUDA the addresses are device memory
# (the real driver's tests: tests/engine/test_host_tier_cuda.py, test_no_kernel_path.py)
pytestmark = pytest.mark.skipif(
    ON_CUDA, reason="memmove stand-ins for the driver: host memory only"
)


class MemmoveDriver:
    """The driver calls ``EngineCopies`` makes, as memmoves, counted."""

    def __init__(self) -> None:
        self.outs = self.ins = 0

    def make_current(self) -> None:
        pass

    def stream(self) -> int:
        return 0

    def wait_stream(self, stream: int) -> None:
        pass

    def copy_out_async(self, src: int, dst: int, n: int, stream: int) -> None:
        self.outs += 1
        ctypes.memmove(dst, src, n)

    def copy_in(self, src: int, dst: int, n: int, stream: int) -> None:
        self.ins += 1
        ctypes.memmove(dst, src, n)


class Kernels:
    """The kernel path's stand-in (tests/host_pages), counting what fell back to it."""

    def __init__(self) -> None:
        self.packed: list[Any] = []

    def pack(self, items: Any, pages: Any, b: int) -> None:
        self.packed += items
        pack(items, pages, b)


def engine_holder(page: int = 4096) -> tuple[PagedHolder, MemmoveDriver, Kernels]:
    driver, kernels = MemmoveDriver(), Kernels()
    copies = EngineCopies(driver, kernels.pack, unpack)  # type: ignore[arg-type]
    c = HostChunks()
    pool = PagePool(1 << 24, c.alloc, c.free, page_bytes=page, chunk_bytes=16 * page)
    return PagedHolder(pool, copies.pack, copies.unpack, "pages"), driver, kernels


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_sizes_slices_and_offsets_come_back_bit_for_bit(dtype: Any) -> None:
    holder, driver, kernels = engine_holder()
    arrays = odd_arrays(dtype, 4096)
    given_back_exactly(holder, arrays)
    copied = sum(1 for a in arrays if a.nbytes)  # an empty array moves nothing
    assert kernels.packed == [] and driver.outs >= copied and driver.ins >= copied


def test_a_layout_that_is_not_rows_goes_through_the_kernels() -> None:
    holder, _, kernels = engine_holder()
    a = sample(12 * 7, mx.float32, 3).reshape(12, 7).T  # columns: no pitch of rows
    mx.eval(a)
    with pytest.raises(ValueError):
        rows(a)
    held = holder.hold([a])
    (b,) = holder.give(held)
    assert len(kernels.packed) == 1 and np.array_equal(raw_bytes(b), raw_bytes(a))


def test_a_real_kv_cache_round_trips(tiny: Any) -> None:
    from tests.helpers import prefill, tokens_for

    model, _, _ = tiny("llama")
    cache, _ = prefill(model, tokens_for(300, seed=5))
    # the live slices of 256-step buffers, as a codec records them
    arrays = [b[..., : c.offset, :] for c in cache for b in (c.keys, c.values)]
    mx.eval(arrays)
    assert any(rows(a)[2] > 1 for a in arrays)  # strided: rows a buffer's row apart
    holder, _, kernels = engine_holder(page=2 << 20)
    got = holder.give(holder.hold(arrays))
    assert kernels.packed == []
    for a, b in zip(arrays, got, strict=True):
        assert np.array_equal(raw_bytes(a), raw_bytes(b))


def test_the_tier_start_check_passes_with_the_engine() -> None:
    holder, _, _ = engine_holder()
    assert proven(holder, 1 << 24) is None


@given(
    width=st.integers(0, 50),
    height=st.integers(1, 6),
    gap=st.integers(0, 9),
    offset=st.integers(0, 100),
    page=st.integers(1, 40),
)
def test_row_segments_lay_every_byte_once_in_order(
    width: int, height: int, gap: int, offset: int, page: int
) -> None:
    pitch = width + gap
    laid: list[tuple[int, int]] = []  # (byte of the array, linear byte of the pages)
    for src, index, within, n in row_segments(width, height, pitch, offset, page):
        assert n > 0 and within + n <= page
        laid += [(src + k, index * page + within + k) for k in range(n)]
    want = [(r * pitch + c, offset + r * width + c) for r in range(height) for c in range(width)]
    assert laid == want
