"""The CUDA kernels persist runs through MLX (``mx.fast.cuda_kernel``).

``device_buffers`` makes zeroed buffers in device memory (a kernel's outputs
live there, MLX's ``cudaMallocAsync``) and reports their addresses, so the
copy engine can fill them behind MLX's back; ``scatter`` moves tensors staged
in such a buffer to their places in others (``Placed``: the row geometry is
worked out on the device, not by the reader threads), one thread block per
piece, in one launch; ``addresses`` reports where arrays' data lie (a save's
read-back, ``cuda/readback``); ``copy_in`` reads a mapped pinned buffer over
PCIe (the bench's limit row); ``pack`` and ``unpack`` move arrays into and out of the host tier's
pinned pages (``cuda/pinned_pool``) through a page table.  Nothing here runs
off the caller's thread: MLX is not thread-safe.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

__all__ = [
    "Placed",
    "addresses",
    "as_tensor",
    "copy_in",
    "device_buffers",
    "scatter",
    "pack",
    "unpack",
]

_GRID = 132 * 2048  # threads of a grid-stride loop (an H200 has 132 SMs)


@functools.cache
def _kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str) -> Any:
    """A kernel compiled once per process (MLX compiles on first call; this keeps the object)."""
    return mx.fast.cuda_kernel(
        name=name, input_names=list(inputs), output_names=list(outputs), source=source
    )


def _grid(nbytes: int) -> tuple[int, int, int]:
    """Threads for a grid-stride loop over ``nbytes`` in 16-byte words: one per word,
    whole blocks of 256, at most _GRID."""
    return (min(_GRID, max(256, -(-nbytes // 16 // 256) * 256)), 1, 1)


class Placed(NamedTuple):
    """Bytes [a, b) of a stored tensor, found at offset ``src`` of a staging buffer:
    its byte o goes to ``dst + (o // row) * pitch + o % row`` if ``o % row < keep``
    (rows of a token block into a capacity-sized buffer; past ``keep`` a partial
    hit's positions stay zero)."""

    src: int
    a: int
    b: int
    dst: int
    row: int
    pitch: int
    keep: int


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


def copy_in(device_ptr: int, nbytes: int, src: mx.array | None = None) -> mx.array:
    """A device array with ``nbytes`` (rounded up to 16) read from a mapped pinned buffer
    (``src``: the kernel's argument for that pointer and size, made once by the caller)."""
    words = -(-nbytes // 16)
    if src is None:
        src = mx.array([device_ptr, words], dtype=mx.uint64)
    (out,) = _kernel("persist_copy_in", ("src",), ("out",), _COPY_IN)(
        inputs=[src],
        grid=_grid(nbytes),
        threadgroup=(256, 1, 1),
        output_shapes=[(words * 16,)],
        output_dtypes=[mx.uint8],
    )
    return out


_ZEROED = """
    const unsigned long long n = words[0];
    uint4* to = reinterpret_cast<uint4*>(out);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        to[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        addr[0] = reinterpret_cast<unsigned long long>(out);
    }
"""


def device_buffers(sizes: list[int]) -> list[tuple[mx.array, int]]:
    """A zeroed device buffer of each size (rounded up to 16 bytes) and its address.

    A kernel's output lives in device memory (MLX's ``cudaMallocAsync``); the
    kernel zeroes it and writes its address, so the copy engine can fill it.
    Returned once every kernel is done: no MLX work on the buffers is pending.
    """
    zeroed = _kernel("persist_zeroed", ("words",), ("out", "addr"), _ZEROED)
    outs: list[mx.array] = []
    addrs: list[mx.array] = []
    for n in sizes:
        words = max(1, -(-n // 16))
        out, addr = zeroed(
            inputs=[mx.array([words], dtype=mx.uint64)],
            grid=_grid(16 * words),
            threadgroup=(256, 1, 1),
            output_shapes=[(words, 16), (1,)],
            output_dtypes=[mx.uint8, mx.uint64],
        )
        outs.append(out)
        addrs.append(addr)
    if not outs:
        return []
    mx.eval(outs, addrs)
    got = np.array(mx.concatenate(addrs)).tolist()
    mx.synchronize()  # the zero fills are done before any copy lands
    return list(zip(outs, [int(a) for a in got], strict=True))


_SCATTER = """
    // one block per piece: bytes [a, b) of a stored tensor, found at staged + src;
    // its byte o goes to dst + (o / row) * pitch + o % row when o % row < keep
    const unsigned long long* t = table + 7 * blockIdx.x;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(staged) + t[0];
    const unsigned long long a = t[1], b = t[2], row = t[4], pitch = t[5], keep = t[6];
    unsigned char* dst = reinterpret_cast<unsigned char*>(t[3]);
    const unsigned long long odd = (reinterpret_cast<unsigned long long>(src) | a | b | t[3]
                                    | row | pitch | keep) & 15;
    if (odd == 0) {
        const unsigned long long n = (b - a) / 16;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned long long o = a + 16 * i, c = o % row;
            if (c < keep) {
                *reinterpret_cast<uint4*>(dst + (o / row) * pitch + c) =
                    reinterpret_cast<const uint4*>(src)[i];
            }
        }
    } else {
        for (unsigned long long i = threadIdx.x; i < b - a; i += blockDim.x) {
            const unsigned long long o = a + i, c = o % row;
            if (c < keep) {
                dst[(o / row) * pitch + c] = src[i];
            }
        }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        done[0] = 1;
    }
"""
_BLOCKS = 1 << 20  # pieces per launch (a grid dimension's bound, with room)


def scatter(staged: mx.array, pieces: list[Placed]) -> None:
    """Every piece from ``staged`` (device bytes) to its place, done when this returns."""
    kernel = _kernel("persist_scatter", ("staged", "table"), ("done",), _SCATTER)
    outs = []
    for i in range(0, len(pieces), _BLOCKS):
        table = mx.array(np.asarray(pieces[i : i + _BLOCKS], dtype=np.uint64).reshape(-1))
        (done,) = kernel(
            inputs=[staged, table],
            grid=(256 * min(_BLOCKS, len(pieces) - i), 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.uint8],
        )
        outs.append(done)
    mx.eval(outs)
    mx.synchronize()  # the kernel wrote memory MLX's graph does not know of


_ADDRESS = """
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        addr[0] = reinterpret_cast<unsigned long long>(a);
    }
"""


def addresses(arrays: list[mx.array]) -> list[int]:
    """The device address of each evaluated, row-contiguous array's data (a kernel
    reads it: a host read would move the buffer into managed memory for good)."""
    kernel = _kernel("persist_address", ("a",), ("addr",), _ADDRESS)
    outs = [
        kernel(
            inputs=[a.reshape(-1).view(mx.uint8)],  # one build for every dtype
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.uint64],
        )[0]
        for a in arrays
    ]
    if not outs:
        return []
    return [int(x) for x in np.array(mx.concatenate(outs)).tolist()]


def as_tensor(flat: mx.array, shape: tuple[int, ...], dtype: Any, nbytes: int) -> mx.array:
    """A buffer's first ``nbytes`` as a tensor (views: the buffer stays its own)."""
    if not nbytes:
        return mx.zeros(shape, dtype=dtype)
    out = flat.view(dtype).reshape(-1)
    if out.size * dtype.size != nbytes:  # the buffer was rounded up to 16 bytes
        out = out[: nbytes // dtype.size]
    return out.reshape(shape)


# Byte o of an entry lies at table[o / page] + o % page (pages are mapped pinned host
# memory, page a multiple of 16).  uint4 words when every address is 16-aligned,
# bytes otherwise and for the tail past the last whole word.  MLX caches a custom
# kernel by name: one build serves every dtype, as the source reads bytes only.
_PAGED = """
    const unsigned long long n = info[0], base = info[1], page = info[2];
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    {decl}
    const bool aligned = ((reinterpret_cast<unsigned long long>(dev) | base | page) & 15) == 0;
    const unsigned long long words = aligned ? n / 16 : 0;
    for (unsigned long long i = tid; i < words; i += stride) {{
        const unsigned long long o = base + 16 * i;
        uint4* host = reinterpret_cast<uint4*>(table[o / page] + o % page);
        {word}
    }}
    for (unsigned long long i = 16 * words + tid; i < n; i += stride) {{
        const unsigned long long o = base + i;
        unsigned char* host = reinterpret_cast<unsigned char*>(table[o / page] + o % page);
        {byte}
    }}
    {done}
"""
_PACK = _PAGED.format(
    decl="const unsigned char* dev = reinterpret_cast<const unsigned char*>(src);",
    word="*host = reinterpret_cast<const uint4*>(dev)[i];",
    byte="*host = dev[i];",
    done="if (tid == 0) { done[0] = 1; }",
)
_UNPACK = _PAGED.format(
    decl="unsigned char* dev = reinterpret_cast<unsigned char*>(out);",
    word="reinterpret_cast<uint4*>(dev)[i] = *host;",
    byte="dev[i] = *host;",
    done="",
)


def pack(items: list[tuple[mx.array, int]], table: list[int], page: int) -> None:
    """Each array's bytes at its byte offset of the pages whose device addresses are
    ``table`` (``page`` bytes each); done when this returns.  An array is a kernel
    input, so MLX hands the kernel a row-contiguous copy of a strided one."""
    kernel = _kernel("persist_pack", ("src", "table", "info"), ("done",), _PACK)
    pages = mx.array(table, dtype=mx.uint64)
    outs = []
    for a, offset in items:
        info = mx.array([a.nbytes, offset, page], dtype=mx.uint64)
        (done,) = kernel(
            inputs=[a, pages, info],
            grid=_grid(a.nbytes),
            threadgroup=(256, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.uint8],
        )
        outs.append(done)
    mx.eval(outs)
    mx.synchronize()  # the pages were written behind MLX's graph: done before reuse


def unpack(
    parts: list[tuple[int, int, tuple[int, ...], Any]], table: list[int], page: int
) -> list[mx.array]:
    """For each (offset, nbytes, shape, dtype): a new device array (a kernel output)
    read from those bytes of the pages over PCIe; evaluated when this returns."""
    kernel = _kernel("persist_unpack", ("table", "info"), ("out",), _UNPACK)
    pages = mx.array(table, dtype=mx.uint64)
    outs = []
    for offset, nbytes, shape, dtype in parts:
        info = mx.array([nbytes, offset, page], dtype=mx.uint64)
        (out,) = kernel(
            inputs=[pages, info],
            grid=_grid(nbytes),
            threadgroup=(256, 1, 1),
            output_shapes=[shape],
            output_dtypes=[dtype],
        )
        outs.append(out)
    mx.eval(outs)
    mx.synchronize()  # read behind MLX's graph: the pages may be freed after this
    return outs


def warm(staged: bool = True) -> None:
    """Build the kernels a process will call now, on bytes of no consequence: the
    host tier's always, the staged restore's (zeroing, scatter, addresses) where
    restores stage (``staged``; a direct ring calls none of them).

    MLX compiles a custom kernel at its first call (seconds on an H200: a fresh
    process's first restore took 4.6 s against 0.09 s later, issue 39), so
    ``persist serve`` calls this before it answers.  The host tier's page table
    is a device buffer here: the kernels only follow pointers."""
    if staged:
        (scratch, at), (dest, to) = device_buffers([64, 64])
        scatter(scratch, [Placed(src=0, a=0, b=16, dst=to, row=16, pitch=16, keep=16)])
        addresses([dest])
    else:
        from .addressing import zeroed

        ((_, at),) = zeroed([64])
    pack([(mx.zeros((16,), dtype=mx.uint8), 0)], [at], 64)
    unpack([(0, 16, (16,), mx.uint8)], [at], 64)
    copy_in(at, 16)
    mx.synchronize()
