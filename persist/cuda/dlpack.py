"""An MLX array's address and layout read from its DLPack export.

Only where the export moves nothing: MLX's CPU backend (and the tests, whose
stand-in drivers copy host memory).  On CUDA, MLX 0.32 exports a device buffer
by copying it into managed memory for good (``Buffer::raw_ptr``), so
``cuda/addressing`` reads addresses there with a kernel instead.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx

__all__ = ["as_rows", "first_byte", "rows"]


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


def first_byte(a: mx.array) -> int:
    """The address of an evaluated array's first element (a view's, with its offset)."""
    cap = a.__dlpack__()  # held while its tensor is read
    t = _DLTensor.from_address(_get(cap, b"dltensor"))
    return int(t.data or 0) + int(t.byte_offset)


def rows(a: mx.array) -> tuple[int, int, int, int]:
    """An evaluated array as rows of bytes (``as_rows``), from its DLPack export."""
    cap = a.__dlpack__()
    t = _DLTensor.from_address(_get(cap, b"dltensor"))
    start = int(t.data or 0) + int(t.byte_offset)
    if not t.strides:  # row-major by definition
        return start, a.nbytes, 1, a.nbytes
    dims = [(int(t.shape[i]), int(t.strides[i])) for i in range(t.ndim)]
    return as_rows(start, a.dtype.size, a.nbytes, [(n, s) for n, s in dims if n != 1])


def as_rows(
    start: int, size: int, nbytes: int, dims: list[tuple[int, int]]
) -> tuple[int, int, int, int]:
    """An array as rows of bytes: (address of the first, bytes a row, rows, bytes from
    one row's start to the next), from its first byte, element ``size`` and the
    (length, stride in elements) of each dimension longer than one.  A KV cache's
    live slice of a larger buffer (``keys[..., :offset, :]``) is one row per head,
    ``offset * D`` elements long, a whole buffer's row apart.  ValueError where the
    outer dimensions do not step by one pitch (no such layout is copied this way)."""
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
