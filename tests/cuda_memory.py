"""Where a CUDA array's bytes live (device or managed memory), asked without moving
them: a host read of an MLX CUDA array (``__dlpack__``, ``np.array``) copies its
buffer into managed memory for good, so the address comes from a kernel
(``addressing``'s PTX one: a row-contiguous array, or a view's first byte)."""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx

from persist.cuda import addressing
from persist.cuda.driver import Driver
from persist.cuda.kernels import addresses

_IS_MANAGED = 8  # CU_POINTER_ATTRIBUTE_IS_MANAGED


def compiled_address(a: mx.array) -> int:
    """The device address of a row-contiguous array's data, as persist's compiled
    kernel sees it (a reference for the PTX one: tests/engine/test_addressing)."""
    return addresses([a])[0]


def managed(a: mx.array) -> bool:
    driver = Driver()
    flag = ctypes.c_uint(0)
    rc = driver.lib.cuPointerGetAttribute(
        ctypes.byref(flag), ctypes.c_int(_IS_MANAGED), ctypes.c_uint64(addressing.address(a))
    )
    assert rc == 0, f"cuPointerGetAttribute returned CUDA error {rc}"
    return bool(flag.value)


def buffers(cache: list[Any]) -> list[mx.array]:
    """Each layer's own buffers (a KV cache's whole keys and values, not the live slice:
    a strided kernel input would be a copy)."""
    out = []
    for c in cache:
        if isinstance(getattr(c, "keys", None), mx.array):
            out += [c.keys, c.values]
        else:
            out += [a for a in c.state if isinstance(a, mx.array) and a.size]
    return out
