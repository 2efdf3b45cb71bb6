"""Pinned host staging for MLX's CUDA backend, and which data path a process takes.

MLX puts an array made from host memory in CUDA managed memory and never
prefetches it: the first kernels that read a restored cache pull it across
page by page (0.64 s per GiB on an H200), and a host read of a live cache
moves it there for good.  Kernel outputs live in device memory.  So on CUDA
a restore stages file bytes in a small ring of page-locked host buffers
(``cuMemHostAlloc``, through ctypes on the driver library that is always
present where MLX's CUDA backend runs) and a copy kernel reads each buffer
over PCIe into its own output: device memory, at the bus's speed.

The choice is made once per process (``choose``): CUDA with the driver and
a ring -> ``cuda-pinned``; anything else (CPU, Metal, no driver, a failed
pinned allocation, ``PERSIST_DATA_PATH=host``) -> ``host``, today's path of
reading into MLX buffers, with the reason kept for ``persist stats``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "Ring",
    "Choice",
    "choose",
    "use",
    "backend",
    "CUDA_PINNED",
    "HOST",
    "SLOT_BYTES",
    "SLOTS",
]

CUDA_PINNED = "cuda-pinned"
HOST = "host"
SLOT_BYTES = 8 << 20  # one staged read: few copy launches, and the bytes still overlap
SLOTS = 16  # the ring: 128 MiB of page-locked memory, allocated once per process
_PORTABLE, _DEVICEMAP = 0x01, 0x02  # CU_MEMHOSTALLOC_*
_GRID = 132 * 2048  # threads of the copy kernel (an H200 has 132 SMs): a grid-stride loop


class Ring:
    """``len(slots)`` staging buffers and how a filled one becomes a device array.

    ``to_device(i, n)`` returns a flat uint8 array with the first ``n`` bytes of
    slot ``i`` (rounded up to 16), in a buffer of its own; the slot may be
    refilled once that array is evaluated.  Slots are handed out by
    ``acquire`` / ``release``; ``lock`` serializes the restores that use them.
    """

    def __init__(self, slots: list[np.ndarray], to_device: Callable[[int, int], mx.array]) -> None:
        self.slots, self.to_device = slots, to_device
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Every slot free again (after a failed restore, once no copy reads them)."""
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.slots)):
            self.free.put(i)

    @property
    def slot_bytes(self) -> int:
        return int(self.slots[0].nbytes)

    def acquire(self, abort: threading.Event) -> int | None:
        """A free slot, or None once ``abort`` is set."""
        while not abort.is_set():
            try:
                return self.free.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def release(self, i: int) -> None:
        self.free.put(i)


@dataclass(frozen=True)
class Choice:
    path: str  # CUDA_PINNED or HOST
    reason: str  # why, in words, for persist stats
    ring: Ring | None = None

    def describe(self) -> str:
        return f"{self.path} ({self.reason})"


_choice: Choice | None = None
_choice_lock = threading.Lock()


def choose() -> Choice:
    """This process's data path, decided on the first call."""
    global _choice
    with _choice_lock:
        if _choice is None:
            _choice = _select()
        return _choice


@contextlib.contextmanager
def use(choice: Choice) -> Iterator[Choice]:
    """Tests: take ``choice`` as this process's data path inside the block."""
    global _choice
    with _choice_lock:
        before, _choice = _choice, choice
    try:
        yield choice
    finally:
        with _choice_lock:
            _choice = before


def _select() -> Choice:
    forced = os.environ.get("PERSIST_DATA_PATH", "")
    if forced == HOST:
        return Choice(HOST, "PERSIST_DATA_PATH=host")
    here = backend()
    if here != "cuda":
        return Choice(HOST, f"MLX runs on {here}: arrays are host memory already")
    try:
        driver = _Driver()
        ring = _cuda_ring(driver, SLOTS, SLOT_BYTES)
    except OSError as e:  # no libcuda.so.1, or a driver call that failed
        return Choice(HOST, f"CUDA driver API unavailable ({e})")
    except MemoryError as e:
        return Choice(HOST, f"pinned host memory refused ({e})")
    return Choice(CUDA_PINNED, f"{SLOTS} pinned staging buffers of {SLOT_BYTES >> 20} MiB", ring)


def backend() -> str:
    dev = mx.default_device()
    if dev.type == mx.cpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "metal"


class _Driver:
    """The few CUDA driver calls the ring needs, on ``libcuda.so.1``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._call("cuInit", ctypes.c_uint(0))
        ctx = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:  # MLX's runtime works in the primary context: allocate in it
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(0))
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self._call("cuCtxSetCurrent", ctx)

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise OSError(f"{name} returned CUDA error {rc}")

    def host_alloc(self, n: int) -> tuple[int, int]:
        """``n`` page-locked bytes mapped for the device: (host address, device address)."""
        p, d = ctypes.c_void_p(), ctypes.c_uint64()
        rc = self.lib.cuMemHostAlloc(
            ctypes.byref(p), ctypes.c_size_t(n), ctypes.c_uint(_PORTABLE | _DEVICEMAP)
        )
        if rc or not p.value:
            raise MemoryError(f"cuMemHostAlloc of {n} bytes returned CUDA error {rc}")
        self._call("cuMemHostGetDevicePointer_v2", ctypes.byref(d), p, ctypes.c_uint(0))
        return int(p.value), int(d.value)


_COPY_IN = """
    const unsigned long long n = src[1];
    const uint4* from = reinterpret_cast<const uint4*>(src[0]);
    uint4* to = reinterpret_cast<uint4*>(out);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        to[i] = from[i];
    }
"""
_kernel: Any = None


def copy_in(device_ptr: int, nbytes: int, src: mx.array | None = None) -> mx.array:
    """A device array with ``nbytes`` (rounded up to 16) read from a mapped pinned buffer
    (``src``: the kernel's argument for that pointer and size, made once by the caller)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="persist_copy_in", input_names=["src"], output_names=["out"], source=_COPY_IN
        )
    words = -(-nbytes // 16)
    if src is None:
        src = mx.array([device_ptr, words], dtype=mx.uint64)
    (out,) = _kernel(
        inputs=[src],
        grid=(min(_GRID, max(256, -(-words // 256) * 256)), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(words * 16,)],
        output_dtypes=[mx.uint8],
    )
    return out


def _cuda_ring(driver: _Driver, n: int, size: int) -> Ring:
    mx.eval(mx.zeros(1))  # MLX's CUDA context exists before the driver allocates in it
    slots, device = [], []
    for _ in range(n):
        host, dev = driver.host_alloc(size)
        slots.append(np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(host)))
        device.append(dev)

    args: dict[tuple[int, int], mx.array] = {}  # (slot, bytes) -> the kernel's argument

    def to_device(i: int, nbytes: int) -> mx.array:
        key = (i, nbytes)
        if key not in args:
            if len(args) > 4096:  # sizes seen before recur (full slots); odd ones go
                args.clear()
            args[key] = mx.array([device[i], -(-nbytes // 16)], dtype=mx.uint64)
        out = copy_in(device[i], nbytes, args[key])
        mx.async_eval(out)
        return out

    return Ring(slots, to_device)
