"""The few CUDA driver calls persist's staging needs, through ctypes on ``libcuda.so.1``.

The driver library is present wherever MLX's CUDA backend runs, so this costs
no dependency.  ctypes releases the GIL for every foreign call: a reader thread
that waits in ``cuEventSynchronize`` or queues a copy lets the other readers
run.  Every address crosses as a 64-bit integer (``c_uint64``): without
``argtypes`` ctypes would pass a Python int as a 32-bit C int.
"""

from __future__ import annotations

import ctypes
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
