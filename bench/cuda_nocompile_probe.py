"""Probe (issue 39): can a restore run with no custom kernel at all?  In a fresh
process: an ``mx.zeros`` buffer's address through DLPack (device memory, not
managed?), its first-call time, and the copy engine's 2D copies (device to
device, pinned to device) for an 8k Llama-3-8B cache's pieces, against the
scatter kernel.  Also a profile of the first restore after ``prepare``.

    python -m bench.cuda_nocompile_probe STORE_ROOT   # a store holding session "s"
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import json
import pstats
import sys
import time
from typing import Any


class Memcpy2D(ctypes.Structure):
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


def dlpack_address(a: Any) -> tuple[int, int]:
    """(data pointer, DLPack device type) of an evaluated array."""
    cap = a.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    p = get(cap, b"dltensor")
    data = ctypes.c_void_p.from_address(p).value or 0
    dev = ctypes.c_int32.from_address(p + 8).value
    return int(data), int(dev)


def main() -> None:
    out: dict[str, Any] = {}
    t = time.perf_counter()
    import mlx.core as mx

    mx.eval(mx.zeros((1,)))
    out["init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    a = mx.zeros((64 << 20,), dtype=mx.uint8)
    mx.eval(a)
    mx.synchronize()
    out["zeros_64MiB_first_s"] = time.perf_counter() - t
    try:
        t = time.perf_counter()
        addr, dev = dlpack_address(a)
        out["dlpack"] = {"addr": addr, "device_type": dev, "s": time.perf_counter() - t}
    except Exception as e:
        out["dlpack"] = {"error": repr(e)}
        addr = 0
    from persist.cuda.driver import Driver

    d = Driver()
    if addr:
        v = ctypes.c_uint()
        rc = d.lib.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(8), ctypes.c_uint64(addr))
        out["is_managed"] = [rc, v.value]
        rc = d.lib.cuPointerGetAttribute(ctypes.byref(v), ctypes.c_int(2), ctypes.c_uint64(addr))
        out["memory_type"] = [rc, v.value]  # 2: device, 1: host
    t = time.perf_counter()
    from persist.cuda import kernels

    got = kernels.addresses([a])[0]
    out["addresses_kernel_first_s"] = time.perf_counter() - t
    out["same_address"] = got == addr
    # 2D copies of an 8k Llama-3-8B cache's pieces: 64 (layers x k/v) tensors of
    # 8 heads x 8192 positions x 256 bytes, stored as 32 blocks of 256 positions
    cap = 8192 + 256
    row, pitch, heads = 256 * 256, cap * 256, 8
    dst = mx.zeros((64 * heads * cap * 256,), dtype=mx.uint8)
    src = mx.zeros((64 * 32 * heads * row,), dtype=mx.uint8)
    mx.eval(dst, src)
    mx.synchronize()
    dd, _ = dlpack_address(dst) if addr else (kernels.addresses([dst])[0], 0)
    ss, _ = dlpack_address(src) if addr else (kernels.addresses([src])[0], 0)
    fn = d.lib.cuMemcpy2DAsync_v2
    fn.argtypes = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p]
    stream = d.stream()
    p = Memcpy2D()
    p.srcMemoryType = p.dstMemoryType = 2  # CU_MEMORYTYPE_DEVICE
    p.WidthInBytes, p.Height, p.srcPitch, p.dstPitch = row, heads, row, pitch
    for rep in range(2):
        t = time.perf_counter()
        off = 0
        for tensor in range(64):
            for block in range(32):
                p.srcDevice = ss + off
                p.dstDevice = dd + tensor * heads * pitch + block * row
                rc = fn(ctypes.byref(p), ctypes.c_void_p(stream))
                assert rc == 0, rc
                off += heads * row
        queued = time.perf_counter() - t
        d.wait_stream(stream)
        out[f"d2d_2d_copies_{rep}"] = {"n": 64 * 32, "queue_s": queued,
                                       "total_s": time.perf_counter() - t}  # fmt: skip
    # the same pieces through the scatter kernel, for comparison
    pieces = []
    off = 0
    for tensor in range(64):
        for block in range(32):
            at = dd + tensor * heads * pitch + block * row
            pieces.append(
                kernels.Placed(src=off, a=0, b=heads * row, dst=at, row=row, pitch=pitch, keep=row)
            )
            off += heads * row
    for rep in range(2):
        t = time.perf_counter()
        kernels.scatter(src, pieces)
        out[f"scatter_kernel_{rep}_s"] = time.perf_counter() - t
    if len(sys.argv) > 1:
        import persist
        from bench.shapes import IDENTITY
        from persist.engine.staged.restore import prepare

        t = time.perf_counter()
        prepare()
        out["prepare_s"] = time.perf_counter() - t
        with persist.Store(sys.argv[1]) as store:
            prof = cProfile.Profile()
            prof.enable()
            r = store.restore("s", identity=IDENTITY)
            mx.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
            out["first_restore_profile"] = s.getvalue()[-6000:]
            del r
            t = time.perf_counter()
            r = store.restore("s", identity=IDENTITY)
            mx.synchronize()
            out["second_restore_s"] = time.perf_counter() - t
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
