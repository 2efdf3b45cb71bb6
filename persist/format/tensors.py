"""Read validated tensors straight into the buffers the caches will use.

Each tensor is read (``preadv``) into a fresh MLX array whose token axis
already has the capacity its codec asks for, and its checksum is computed
over exactly the bytes read.  No intermediate copy: peak memory is the
restored cache itself, and the first decode step after a restore does not
reallocate.  A tensor stored in pieces (the store's token blocks) is read
piece by piece into the same buffer.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import mlx.core as mx
import xxhash

from ..errors import CorruptBlobError, UnsupportedCacheError
from ..records import DTYPE_SIZES, TensorSpec

IOV_MAX = min(getattr(os, "IOV_MAX", 1024), 1024)  # buffers per preadv
BATCH_BYTES = 2 << 20  # bytes per scatter read: large requests, still in the CPU's cache to hash

__all__ = [
    "MX_TO_NAME",
    "NAME_TO_MX",
    "dtype_name",
    "as_bytes",
    "allocate",
    "allocate_many",
    "read_piece",
    "read_pieces",
    "Piece",
    "on_cuda",
    "device_copy",
]

MX_TO_NAME: dict[Any, str] = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.float32: "F32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float64: "F64",
}
NAME_TO_MX: dict[str, Any] = {v: k for k, v in MX_TO_NAME.items()}


def dtype_name(a: mx.array) -> str:
    """The file-format name of an array's dtype; a dtype the format lacks is refused."""
    try:
        return MX_TO_NAME[a.dtype]
    except KeyError:
        names = ", ".join(sorted(NAME_TO_MX))
        raise UnsupportedCacheError(
            f"dtype {a.dtype} cannot be stored (the format holds {names})"
        ) from None


def allocate(spec: TensorSpec, cap: int | None, axis: int = 2) -> tuple[mx.array, memoryview]:
    """A zeroed MLX array for ``spec`` (token axis grown to ``cap``) and a writable view."""
    return allocate_many([(spec, cap, axis)])[0]


def grown_shape(spec: TensorSpec, cap: int | None, axis: int) -> tuple[int, ...]:
    """``spec``'s shape with its ``axis`` grown to the capacity ``cap`` (a KV cache's
    room past its offset), never shrunk."""
    shape = list(spec.shape)
    if cap is not None and len(shape) > axis and cap > shape[axis]:
        shape[axis] = cap
    return tuple(shape)


def allocate_many(
    wanted: list[tuple[TensorSpec, int | None, int]],
) -> list[tuple[mx.array, memoryview]]:
    """``allocate`` for many tensors at once: on the CPU the zero fills (which also
    fault in the fresh pages) run on several MLX streams, one thread each."""
    streams = _fill_streams() if mx.default_device() == mx.cpu else [None]
    arrays = []
    for i, (spec, cap, axis) in enumerate(wanted):
        shape = grown_shape(spec, cap, axis)
        arrays.append(
            mx.zeros(shape, dtype=NAME_TO_MX[spec.dtype], stream=streams[i % len(streams)])
        )
    mx.eval(arrays)
    return [
        (out, _writable(out, spec.dtype)) for out, (spec, _, _) in zip(arrays, wanted, strict=True)
    ]


def _writable(out: mx.array, dtype: str) -> memoryview:
    if out.size == 0:
        return memoryview(bytearray())
    view = memoryview(out).cast("B")  # type: ignore[arg-type]
    if not view.contiguous or view.nbytes != out.size * DTYPE_SIZES[dtype]:
        raise RuntimeError("mlx returned a buffer persist cannot read into")
    return view


_local = threading.local()  # MLX streams belong to the thread that made them
_lock = threading.Lock()
_threads_with_streams = 0
STREAM_THREADS = 8  # threads that get fill streams: MLX never frees a stream's OS thread


def _fill_streams() -> list[Any]:
    """This thread's fill streams.  Only the first STREAM_THREADS threads that
    restore get their own (a server restoring on a thread per request would
    otherwise leak two OS threads per request); later ones fill on their default."""
    global _threads_with_streams
    streams: list[Any] | None = getattr(_local, "streams", None)
    if streams is None:
        with _lock:
            allowed = _threads_with_streams < STREAM_THREADS
            _threads_with_streams += allowed
        n = max(1, min(4, os.cpu_count() or 1))
        streams = [mx.new_stream(mx.cpu) for _ in range(n)] if allowed else [None]
        _local.streams = streams
    return streams


class Piece(NamedTuple):
    """A stored tensor to read: where it starts in the file, into which buffer where."""

    start: int
    stored: TensorSpec
    into: memoryview
    alloc_shape: tuple[int, ...]
    at: int  # first position along ``axis`` the stored tensor fills
    axis: int
    want: bytes  # its checksum
    where: str


def read_piece(
    fd: int,
    start: int,
    stored: TensorSpec,
    into: memoryview,
    *,
    alloc_shape: tuple[int, ...],
    at: int,
    axis: int,
    want: bytes,
    where: str,
) -> None:
    """Read a stored tensor into ``into`` at position ``at`` of ``axis``; verify it."""
    piece = Piece(
        start=start,
        stored=stored,
        into=into,
        alloc_shape=alloc_shape,
        at=at,
        axis=axis,
        want=want,
        where=where,
    )
    read_pieces(fd, [piece])


def read_pieces(fd: int, pieces: list[Piece]) -> None:
    """Read and verify many tensors of one file.  Tensors that follow each other
    in the file go in one scatter read of up to BATCH_BYTES, hashed right after
    it while their bytes are still in the CPU's cache: a block of 64 tensors
    costs a few system calls, not 64."""
    batch: list[tuple[Piece, list[memoryview]]] = []
    iov: list[memoryview] = []
    pos = size = 0

    def flush() -> None:
        nonlocal size
        _scatter(fd, iov, pos, batch[-1][0].where if batch else "")
        for p, regs in batch:
            _verify(p, regs)
        size = 0
        batch.clear()
        iov.clear()

    for p in sorted(pieces, key=lambda p: p.start):
        item = DTYPE_SIZES[p.stored.dtype]
        regs = list(_regions(p.into, p.stored.shape, p.alloc_shape, p.at, p.axis, item))
        if p.start != pos + size or size >= BATCH_BYTES:
            flush()
            pos = p.start
        batch.append((p, regs))
        iov.extend(regs)
        size += sum(r.nbytes for r in regs)
    flush()


def _verify(p: Piece, regs: list[memoryview]) -> None:
    h = xxhash.xxh3_128()
    for r in regs:
        h.update(r)
    if h.digest() != p.want:
        raise CorruptBlobError(p.where, "checksum mismatch in tensor data")


def _scatter(fd: int, iov: list[memoryview], pos: int, where: str) -> None:
    """Read consecutive file bytes into ``iov``, IOV_MAX buffers per system call."""
    for i in range(0, len(iov), IOV_MAX):
        run = iov[i : i + IOV_MAX]
        size = sum(r.nbytes for r in run)
        if size and os.preadv(fd, run, pos) != size:
            raise CorruptBlobError(where, "file truncated inside a tensor")
        pos += size


def _regions(
    view: memoryview,
    stored: tuple[int, ...],
    alloc: tuple[int, ...],
    at: int,
    axis: int,
    item: int,
) -> Iterator[memoryview]:
    """The regions of ``view`` that receive the stored tensor, in file order."""
    if tuple(stored) == tuple(alloc) and at == 0:
        if view.nbytes:
            yield view
        return
    inner = math.prod(stored[axis + 1 :]) * item
    size = stored[axis] * inner
    stride = alloc[axis] * inner
    if not size:
        return
    for r in range(math.prod(stored[:axis])):
        base = r * stride + at * inner
        yield view[base : base + size]


def as_bytes(a: Any) -> memoryview:
    """The raw row-major bytes of an mx.array (evaluated; copied only if strided)."""
    import mlx.core as mx

    if a.size == 0:
        return memoryview(b"")
    mx.eval(a)
    if a.ndim:
        view = memoryview(a)
        if view.c_contiguous:  # .contiguous is also true of column-major (a.T)
            return view.cast("B")
        a = mx.contiguous(a)
    else:
        a = a.reshape(1)
    mx.eval(a)
    return memoryview(a).cast("B")


def on_cuda() -> bool:
    """Is MLX computing on its CUDA backend (where host access to arrays is costly)?"""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device().type == mx.gpu and cuda is not None and bool(cuda.is_available())


_SAME_SIZE_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def device_copy(a: mx.array) -> mx.array:
    """A bit-exact copy in a buffer of its own (an integer view plus zero: -0.0 and
    NaN payloads stay as they are)."""
    if a.size == 0 or a.dtype == mx.bool_:
        return mx.array(a)
    u = _SAME_SIZE_UINT[a.dtype.size]
    return (a.view(u) + mx.array(0, dtype=u)).view(a.dtype)
