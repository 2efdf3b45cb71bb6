"""Device addresses and zeroed device buffers with no kernel of persist's own.

A custom kernel is compiled at its first call in every process (1.2 to 1.4 s
each on an H200, issue 39), so a CLI process's first restore or save paid
seconds for a few pointers.  MLX exports an evaluated array through DLPack
without moving it (on MLX 0.32 its CUDA buffers stay in device memory: checked
by ``bench/cuda_nocompile_probe``), and ``mx.zeros`` is filled by MLX's own
prebuilt kernels, so both come at the cost of a driver query.
"""

from __future__ import annotations

import ctypes
import math

import mlx.core as mx

__all__ = ["address", "addresses", "rows", "zeroed"]


class _DLTensor(ctypes.Structure):
    """The head of DLPack's ``DLManagedTensor`` (its ``dl_tensor``), v0.8."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_get = ctypes.pythonapi.PyCapsule_GetPointer
_get.restype, _get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


def address(a: mx.array) -> int:
    """The address of an evaluated, row-contiguous array's first byte.

    ValueError for an array whose elements are not row-contiguous (a strided
    view): its bytes are not ``nbytes`` from that address on."""
    cap = a.__dlpack__()
    t = _DLTensor.from_address(_get(cap, b"dltensor"))
    if t.strides:
        shape = [t.shape[i] for i in range(t.ndim)]
        want, step = [], 1
        for n in reversed(shape):
            want.append(step)
            step *= n
        got = [t.strides[i] for i in range(t.ndim)]
        # a dimension of size 1 may carry any stride
        if any(s != w and n != 1 for s, w, n in zip(got, reversed(want), shape, strict=True)):
            raise ValueError(f"an array of shape {shape} with strides {got} is not contiguous")
    return int(t.data or 0) + int(t.byte_offset)


def rows(a: mx.array) -> tuple[int, int, int, int]:
    """An evaluated array as rows of bytes: (address of the first, bytes a row, rows,
    bytes from one row's start to the next).  A KV cache's live slice of a larger
    buffer (``keys[..., :offset, :]``) is one row per head, ``offset * D`` elements
    long, a whole buffer's row apart.  ValueError where the outer dimensions do
    not step by one pitch (no such layout is copied this way)."""
    cap = a.__dlpack__()
    t = _DLTensor.from_address(_get(cap, b"dltensor"))
    start = int(t.data or 0) + int(t.byte_offset)
    size = a.dtype.size
    dims = [(int(t.shape[i]), int(t.strides[i]) if t.strides else 0) for i in range(t.ndim)]
    if not t.strides:  # row-major by definition
        return start, a.nbytes, 1, a.nbytes
    dims = [(n, s) for n, s in dims if n != 1]  # a dimension of size 1 may carry any stride
    width, k = 1, len(dims)  # elements a row; the row's dimensions are dims[k:]
    while k and dims[k - 1][1] == width:
        width *= dims[k - 1][0]
        k -= 1
    height, pitch = 1, 0
    if k:
        pitch = dims[k - 1][1]
        step = pitch
        for n, s in reversed(dims[:k]):
            if s != step:
                raise ValueError(f"an array with strides {[s for _, s in dims]} is not rows")
            step *= n
            height *= n
    if height > 1 and pitch < width:
        raise ValueError(f"rows of {width} elements {pitch} apart overlap")
    return start, width * size, height, max(pitch, width) * size


def addresses(arrays: list[mx.array]) -> list[int]:
    """Each evaluated, row-contiguous array's address (``address``)."""
    return [address(a) for a in arrays]


def zeroed(sizes: list[int]) -> list[tuple[mx.array, int]]:
    """A zeroed device buffer of each size (rounded up to 16 bytes) and its address;
    returned once the fills are done (nothing MLX queued on them is pending)."""
    outs = [mx.zeros((max(1, math.ceil(n / 16)), 16), dtype=mx.uint8) for n in sizes]
    if not outs:
        return []
    mx.eval(outs)
    mx.synchronize()  # the zero fills are done before any copy lands
    return [(o, address(o)) for o in outs]
