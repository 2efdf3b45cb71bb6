"""Where an MLX array's bytes lie on the device, without moving them.

MLX's CUDA backend exports an array through DLPack only as host memory: its
``__dlpack__`` calls ``Buffer::raw_ptr``, which copies a device buffer into
managed memory for good (``move_to_unified_memory``, MLX 0.32).  Reading
addresses that way made every restored tensor, and every KV cache a save read,
managed memory: the next kernels that touched them migrated pages on demand,
and once freed MLX's buffer cache handed them to later kernel outputs
(the H100 run of round 5: a restored conversation answered no faster than a
prefill).  So on CUDA a kernel reports the address: a hand-written PTX entry
(``mx.fast.precompiled_cuda_kernel``: no NVRTC compile, the driver loads PTX
this small in milliseconds) that stores its input's pointer, the input passed
as it lies (``ensure_row_contiguous=False``: a strided view is not copied).
A view's strides are read the same way, from the addresses of its views one
element along each dimension.  Elsewhere (MLX's CPU backend, the tests) DLPack
moves nothing and is used as it is.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import dlpack

__all__ = [
    "address", "addresses", "kernel_proven", "rows", "rows_from", "usable", "zeroed", "PTX",
]  # fmt: skip

log = logging.getLogger("persist")

# extern "C" __global__ void persist_where(const void* a, unsigned long long* out)
# { *out = (unsigned long long)a; }  -- PTX ISA 7.0 loads on every driver MLX's CUDA
# build runs on; the driver compiles it for the device it finds
PTX = b"""//
.version 7.0
.target sm_70
.address_size 64

.visible .entry persist_where(
    .param .u64 persist_where_param_0,
    .param .u64 persist_where_param_1
)
{
    .reg .b64 %rd<4>;

    ld.param.u64 %rd1, [persist_where_param_0];
    ld.param.u64 %rd2, [persist_where_param_1];
    cvta.to.global.u64 %rd3, %rd2;
    st.global.u64 [%rd3], %rd1;
    ret;
}
"""

Dims = list[tuple[int, int]]  # (size, stride in elements) of each dimension


def _where(a: mx.array) -> mx.array:
    return mx.fast.precompiled_cuda_kernel(
        name="persist_where", compiled_source=PTX, inputs=[a], output_shapes=[(1,)],
        output_dtypes=[mx.uint64], scalars=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
        shared_memory=0, ensure_row_contiguous=False,
    )[0]  # fmt: skip


def _kernel_addresses(arrays: Sequence[mx.array]) -> list[int]:
    """Each array's first byte, read by the PTX kernel (one launch per array, one
    host read for all: the small output read on the host is the only buffer moved)."""
    if not arrays:
        return []
    outs = [_where(a) for a in arrays]
    return [int(x) for x in np.array(mx.concatenate(outs)).tolist()]


@functools.cache
def _on_cuda() -> bool:
    """MLX computes on its CUDA backend (asked once: the device does not change)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and bool(cuda.is_available())


@functools.cache
def kernel_proven() -> bool:
    """Does the PTX kernel report where bytes are?  Checked once per process, before
    any copy relies on it: an array of known values and a view of it at an offset,
    read back through the driver at the addresses it gave.  False (the PTX did not
    load, or the bytes differ) turns the direct path off (``usable``)."""
    whole = mx.arange(4 * 16, dtype=mx.uint32).reshape(4, 16)
    view = whole[1:3, 2:10]
    mx.eval(whole, view)
    try:
        at, at_view = _kernel_addresses([whole, view])
        from .driver import Driver

        driver = Driver()
        driver.make_current()
        got = np.empty(64, dtype=np.uint32)
        driver.copy_out(at, got.ctypes.data, got.nbytes)
    except Exception as e:  # a driver or an MLX build that does not take the PTX
        log.warning("persist: the address kernel is not used here (%s)", e)
        return False
    want = np.arange(64, dtype=np.uint32)
    return bool(np.array_equal(got, want) and at_view == at + (16 + 2) * 4)


def usable() -> bool:
    """Can addresses be read here without moving arrays?  On the CPU always; on CUDA
    where the PTX kernel was proven (``kernel_proven``).  Where not, the direct
    path is off (``pinned.direct``) and copies stage through persist's compiled
    kernels, which know their outputs' addresses."""
    return not _on_cuda() or kernel_proven()


def addresses(arrays: Sequence[mx.array]) -> list[int]:
    """Each evaluated array's first byte (a view's, with its offset); nothing moved.
    ValueError where addresses cannot be read so (``usable``)."""
    if not _on_cuda():
        return [dlpack.first_byte(a) for a in arrays]
    if not kernel_proven():
        raise ValueError("no array's address is read here: the address kernel failed its check")
    return _kernel_addresses(arrays)


def address(a: mx.array) -> int:
    """The address of an evaluated, row-contiguous array's first byte; ValueError for
    a strided view (its bytes are not ``nbytes`` from there on) and where addresses
    cannot be read here (``usable``)."""
    try:
        start, width, height, pitch = rows(a)
    except ValueError:
        raise ValueError(f"an array of shape {a.shape} is not contiguous") from None
    if width * height != a.nbytes or (height > 1 and pitch != width):
        raise ValueError(f"an array of shape {a.shape} is not contiguous")
    return start


def rows(a: mx.array) -> tuple[int, int, int, int]:
    """An evaluated array as rows of bytes (``rows_from``), read where it lies."""
    if not _on_cuda():
        return dlpack.rows(a)
    if not kernel_proven():
        raise ValueError("no array's rows are read here: the address kernel failed its check")
    return rows_from(a, _kernel_addresses)


def rows_from(
    a: mx.array, where: Callable[[Sequence[mx.array]], list[int]]
) -> tuple[int, int, int, int]:
    """``dlpack.rows`` from addresses alone: the array's first byte and, for each
    dimension longer than one, the first byte of its view one element on (``where``
    reads them all at once); a stride that is not whole elements, or that goes
    back, is ValueError (no such layout is copied this way)."""
    mx.eval(a)
    longer = [i for i, n in enumerate(a.shape) if n > 1]
    views = [a]
    for i in longer:
        index = tuple(slice(1, None) if j == i else slice(None) for j in range(a.ndim))
        views.append(a[index])
    mx.eval(views)
    found = where(views)
    size = a.dtype.size
    dims: Dims = []
    for i, at in zip(longer, found[1:], strict=True):
        step = at - found[0]
        if step < 0 or step % size:
            raise ValueError(f"dimension {i} of an array steps {step} bytes")
        dims.append((a.shape[i], step // size))
    return dlpack.as_rows(found[0], size, a.nbytes, dims)


def zeroed(sizes: list[int]) -> list[tuple[mx.array, int]]:
    """A zeroed device buffer of each size (rounded up to 16 bytes) and its address,
    returned once the fills are done; filled by MLX's own prebuilt kernels, so in
    device memory (a kernel's output), and left there."""
    outs = [mx.zeros((max(1, math.ceil(n / 16)), 16), dtype=mx.uint8) for n in sizes]
    if not outs:
        return []
    mx.eval(outs)
    found = addresses(outs)
    mx.synchronize()  # the zero fills are done before any copy lands
    return list(zip(outs, found, strict=True))
