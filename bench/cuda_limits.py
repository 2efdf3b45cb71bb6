"""The machine's own limits for a restore on MLX's CUDA backend, as bench rows.

For a store's blob files: the 8-thread read of them into one reused pinned
buffer (warm and cold), the copy of those bytes from pinned memory into
device memory by the copy kernel, and both followed by a full GPU read of
the result: what a restore could take at best on this machine, measured in
the same run as the restore (bench_throughput adds these to every case).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.common import evict, warm
from persist.cuda import kernels as cuda_kernels
from persist.cuda.driver import Driver

THREADS = 8
PART = 1 << 30
_buffers: dict[int, tuple[np.ndarray, int]] = {}  # size -> (pinned view, device address)


def pinned_buffer(n: int) -> tuple[np.ndarray, int]:
    """A pinned buffer of at least ``n`` bytes, allocated once (pinning is slow)."""
    for size, got in _buffers.items():
        if size >= n:
            return got
    import ctypes

    host, dev = Driver().host_alloc(n)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(host))
    _buffers[n] = (view, dev)
    return view, dev


def read_into(paths: list[Path], buf: np.ndarray) -> int:
    """Read ``paths`` on THREADS threads into consecutive regions of ``buf``."""
    sizes = [p.stat().st_size for p in paths]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int).tolist()
    view = memoryview(buf).cast("B")  # type: ignore[arg-type]

    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            pos, end = 0, sizes[i]
            while pos < end:
                n = os.preadv(fd, [view[starts[i] + pos : starts[i] + end]], pos)
                if n <= 0:
                    raise OSError(f"{paths[i]}: short read")
                pos += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(one, range(len(paths))))
    return int(starts[-1])


def rows(blobs: Callable[[], list[Path]]) -> dict[str, tuple[Any, Any]]:
    """The limit ops (setup, timed) for a store whose files ``blobs()`` lists."""
    total = sum(p.stat().st_size for p in blobs())
    buf, dev = pinned_buffer(total + 16)  # the copy reads whole 16-byte words

    def copy() -> list[mx.array]:
        # MLX's shapes are 32-bit: one output per GiB (a 4 GiB array crashed it)
        out = [
            cuda_kernels.copy_in(dev + at, min(PART, total - at)) for at in range(0, total, PART)
        ]
        mx.eval(out)
        return out

    driver = Driver()
    stream = driver.stream()
    dests = cuda_kernels.device_buffers([min(PART, total - at) for at in range(0, total, PART)])

    def dma() -> None:
        # the copy engine, as the restore uses it: 8 MiB copies queued on one stream
        for i, at in enumerate(range(0, total, PART)):
            n, dst = min(PART, total - at), dests[i][1]
            for off in range(0, n, 8 << 20):
                w = min(8 << 20, n - off)
                driver.copy_in(int(buf.ctypes.data) + at + off, dst + off, w, stream)
        driver.wait_stream(stream)

    def read_copy_sum() -> None:
        read_into(blobs(), buf)
        mx.eval([o.view(mx.uint32).sum() for o in copy()])  # a full GPU read of what arrived

    def warm_all() -> None:
        for p in blobs():
            warm(p)

    def evict_all() -> None:
        for p in blobs():
            evict(p)

    return {
        "limit: 8-thread read into pinned (warm)": (
            warm_all,
            lambda: read_into(blobs(), buf),
        ),
        "limit: pinned -> device copy": (None, copy),
        "limit: pinned -> device (copy engine)": (None, dma),
        "limit: read + copy + GPU read (warm)": (warm_all, read_copy_sum),
        "limit: 8-thread read into pinned (cold)": (
            evict_all,
            lambda: read_into(blobs(), buf),
        ),
    }
