"""The few CUDA driver calls persist's staging needs, through ctypes on ``libcuda.so.1``.

The driver library is present wherever MLX's CUDA backend runs, so this costs
no dependency.  ctypes releases the GIL for every foreign call: a reader thread
that waits in ``cuEventSynchronize`` or queues a copy lets the other readers
run.  Every address crosses as a 64-bit integer (``c_uint64``): without
``argtypes`` ctypes would pass a Python int as a 32-bit C int.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Driver"]

_PORTABLE, _DEVICEMAP = 0x01, 0x02  # CU_MEMHOSTALLOC_*
_NON_BLOCKING = 0x01  # CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream
_NO_TIMING = 0x02  # CU_EVENT_DISABLE_TIMING: the cheapest event
_HOST, _DEVICE = 1, 2  # CU_MEMORYTYPE_*


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``: a strided copy of ``Height`` rows of ``WidthInBytes``."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]  # fmt: skip


class _CopyAttrs(ctypes.Structure):
    """``CUmemcpyAttributes``: source access order, source and destination location
    hints (``CUmemLocation``: type, id), flags."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int), ("srcType", ctypes.c_int), ("srcId", ctypes.c_int),
        ("dstType", ctypes.c_int), ("dstId", ctypes.c_int), ("flags", ctypes.c_uint),
    ]  # fmt: skip


_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_LOC_DEVICE, _LOC_HOST = 1, 2  # CU_MEM_LOCATION_TYPE_*
_BATCH_SINCE = 12080  # cuMemcpyBatchAsync came with CUDA 12.8; 13.0 dropped its failIdx


def _bind_batch(lib: Any, version: int) -> Callable[..., int] | None:
    """The driver's batched copy as one signature (CUDA 13's: dsts, srcs, sizes, count,
    attrs, attr indexes, attr count, stream), or None where this driver has none."""
    if version < _BATCH_SINCE:
        return None
    v2 = getattr(lib, "cuMemcpyBatchAsync_v2", None)
    if v2 is not None:
        return v2
    v1 = getattr(lib, "cuMemcpyBatchAsync", None)
    if v1 is None:
        return None
    fail = ctypes.c_size_t()  # 12.x's extra argument: where a failed batch stopped
    return lambda d, s, n, c, a, i, na, st: v1(d, s, n, c, a, i, na, ctypes.byref(fail), st)


class Driver:
    """The driver in MLX's context (the device's primary context, which the CUDA
    runtime that MLX uses works in)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._call("cuInit", ctypes.c_uint(0))
        ctx = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        if not ctx.value:
            dev = ctypes.c_int()
            self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(0))
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
            self._call("cuCtxSetCurrent", ctx)
        self.ctx = ctx
        # the call made per copy: bound once, 64-bit arguments declared
        self._htod = self.lib.cuMemcpyHtoDAsync_v2
        self._htod.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self._dtoh = self.lib.cuMemcpyDtoH_v2
        self._dtoh.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self._dtoh_async = self.lib.cuMemcpyDtoHAsync_v2
        self._dtoh_async.argtypes = [
            ctypes.c_void_p,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        self._2d = self.lib.cuMemcpy2DAsync_v2
        self._2d.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        version = ctypes.c_int()
        self._call("cuDriverGetVersion", ctypes.byref(version))
        self.version = version.value
        # pieces' rows in one call per slot (issue 39): on once prove_batch has seen
        # the call put bytes where strided copies do
        self.batched = False
        self._batch = _bind_batch(self.lib, self.version)
        self._attrs = _CopyAttrs(_ORDER_STREAM, _LOC_HOST, 0, _LOC_DEVICE, 0, 0)
        self._attr_at = (ctypes.c_size_t * 1)(0)

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            raise OSError(f"{name} returned CUDA error {rc}")

    def make_current(self) -> None:
        """This thread works in MLX's context (the current context is per thread)."""
        self._call("cuCtxSetCurrent", self.ctx)

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

    def host_register(self, host: int, n: int) -> None:
        """Page-lock ``n`` bytes of existing host memory (a shared mapping) for the copy engine."""
        rc = self.lib.cuMemHostRegister_v2(
            ctypes.c_void_p(host), ctypes.c_size_t(n), ctypes.c_uint(_PORTABLE)
        )
        if rc:
            raise MemoryError(f"cuMemHostRegister of {n} bytes returned CUDA error {rc}")

    def host_free(self, host: int) -> None:
        """Give page-locked memory from ``host_alloc`` back to the system."""
        self._call("cuMemFreeHost", ctypes.c_void_p(host))

    def free_memory(self) -> int:
        """Bytes of device memory the driver could still hand out (cuMemGetInfo)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return int(free.value)

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(_NON_BLOCKING))
        return int(s.value or 0)

    def event(self) -> int:
        e = ctypes.c_void_p()
        self._call("cuEventCreate", ctypes.byref(e), ctypes.c_uint(_NO_TIMING))
        return int(e.value or 0)

    def record(self, event: int, stream: int) -> None:
        self._call("cuEventRecord", ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def wait_event(self, event: int) -> None:
        self._call("cuEventSynchronize", ctypes.c_void_p(event))

    def wait_stream(self, stream: int) -> None:
        self._call("cuStreamSynchronize", ctypes.c_void_p(stream))

    def copy_in(self, src: int, dst: int, n: int, stream: int) -> None:
        """Queue a copy of ``n`` bytes from page-locked host memory at ``src`` to device
        memory at ``dst`` on ``stream``: the copy engine, at the bus's speed."""
        rc = self._htod(dst, src, n, stream)
        if rc:
            raise OSError(f"cuMemcpyHtoDAsync returned CUDA error {rc}")

    def copy_out(self, src: int, dst: int, n: int) -> None:
        """Copy ``n`` bytes of device memory at ``src`` to host memory at ``dst``;
        done on return (the GIL released meanwhile)."""
        rc = self._dtoh(dst, src, n)
        if rc:
            raise OSError(f"cuMemcpyDtoH returned CUDA error {rc}")

    def copy_out_async(self, src: int, dst: int, n: int, stream: int) -> None:
        """Queue a copy of ``n`` device bytes at ``src`` into page-locked host memory
        at ``dst`` on ``stream`` (the copy engine, at the bus's speed)."""
        rc = self._dtoh_async(dst, src, n, stream)
        if rc:
            raise OSError(f"cuMemcpyDtoHAsync returned CUDA error {rc}")

    def copy_rows_in(
        self, src: int, dst: int, width: int, height: int, spitch: int, dpitch: int, stream: int
    ) -> None:
        """Queue ``height`` rows of ``width`` bytes from page-locked host memory at
        ``src`` (rows ``spitch`` apart) to device memory at ``dst`` (rows ``dpitch``
        apart) on ``stream``: one driver call for a strided piece (the copy engine)."""
        if height == 1:
            return self.copy_in(src, dst, width, stream)
        c = _Memcpy2D()
        c.srcMemoryType, c.srcHost, c.srcPitch = _HOST, src, spitch
        c.dstMemoryType, c.dstDevice, c.dstPitch = _DEVICE, dst, dpitch
        c.WidthInBytes, c.Height = width, height
        rc = self._2d(ctypes.byref(c), stream)
        if rc:
            raise OSError(f"cuMemcpy2DAsync returned CUDA error {rc}")

    def copy_batch_in(self, srcs: Sequence[int], dsts: Sequence[int], sizes: Sequence[int],
                      stream: int) -> None:  # fmt: skip
        """Queue ``len(srcs)`` copies from page-locked host memory to device memory on
        ``stream`` in one driver call (``cuMemcpyBatchAsync``, sources read in stream
        order); only once ``prove_batch`` has turned ``batched`` on.  Nothing to copy
        (a slot whose pieces keep no byte, past a partial hit's end): no driver call."""
        n = len(srcs)
        if not self.batched or self._batch is None:
            raise OSError("this driver's batched copies are not in use")
        if n == 0:
            return
        rc = self._batch(
            (ctypes.c_uint64 * n)(*dsts), (ctypes.c_uint64 * n)(*srcs),
            (ctypes.c_size_t * n)(*sizes), ctypes.c_size_t(n), ctypes.byref(self._attrs),
            self._attr_at, ctypes.c_size_t(1), ctypes.c_void_p(stream),
        )  # fmt: skip
        if rc:
            raise OSError(f"cuMemcpyBatchAsync returned CUDA error {rc}")

    def prove_batch(self) -> bool:
        """Turn ``batched`` on if this driver has batched copies and they put rows where
        strided copies do: a pattern in page-locked memory copied both ways into
        device memory, all of the driver's own, and read back.  False (strided copies
        stay) on any difference or error: a call that is new in CUDA 12.8 is not
        trusted to place a cache's bytes untested."""
        if self._batch is None:
            return False
        self.make_current()
        dev, back = ctypes.c_uint64(), (ctypes.c_uint8 * 8192)()
        try:
            src, _ = self.host_alloc(4096)
            self._call("cuMemAlloc_v2", ctypes.byref(dev), ctypes.c_size_t(16384))
        except (OSError, MemoryError):
            return False
        stream = self.stream()
        try:
            ctypes.memmove(src, bytes((i * 7 + 3) % 251 for i in range(4096)), 4096)
            self._call("cuMemsetD8_v2", dev, ctypes.c_ubyte(0), ctypes.c_size_t(16384))
            self.copy_rows_in(src, dev.value, 1000, 4, 1024, 2048, stream)
            self.batched = True
            self.copy_batch_in(
                [src + r * 1024 for r in range(4)], [dev.value + 8192 + r * 2048 for r in range(4)],
                [1000] * 4, stream,
            )  # fmt: skip
            self.wait_stream(stream)
            self.copy_out(dev.value, ctypes.addressof(back), 8192)
            strided = bytes(back)
            self.copy_out(dev.value + 8192, ctypes.addressof(back), 8192)
            self.batched = strided == bytes(back) and strided[:1000] == ctypes.string_at(src, 1000)
        except OSError as e:
            logging.getLogger("persist").info("persist: batched copies not used: %s", e)
            self.batched = False
        finally:
            self._call("cuStreamDestroy_v2", ctypes.c_void_p(stream))
            self._call("cuMemFree_v2", dev)
            self.host_free(src)
        return self.batched
