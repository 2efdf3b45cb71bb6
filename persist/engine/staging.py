"""A restore on MLX's CUDA backend: blobs through the pinned ring into device memory.

Reader threads open and check each blob as the host path does, read its
wanted tensors in slot-sized chunks into free slots of the ring
(``format/pinned.Ring``) and hash every tensor on the host while its bytes
sit in the slot; the caller's thread turns each filled slot into a device
array (the copy kernel) while the readers fill the next ones, and hands the
slot back once that copy is done.  Host memory above the cache: the ring.
Then each tensor is cut from its chunks on the device and its pieces (the
token blocks) joined into one capacity-sized buffer of its own.  MLX runs
only on the caller's thread; the readers touch host memory only.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import mlx.core as mx
import xxhash

from ..errors import CorruptBlobError
from ..format.pinned import Ring
from ..format.tensors import NAME_TO_MX, device_copy
from ..records import DTYPE_SIZES, Progress, TensorSpec

__all__ = ["Want", "Job", "stage", "assemble", "READERS"]

READERS = 8  # blobs read at once: 8 threads reach a warm page cache's speed on an H200
GAP = 4096  # wanted tensors this close in a file are read as one run (the gap is skipped)


class Want(NamedTuple):
    """A stored tensor to take from a blob: its bytes [start, end) in the file."""

    key: str
    start: int
    end: int
    stored: TensorSpec
    at: int  # first position along the key's axis it fills
    want: bytes  # its checksum
    where: str


class Job(NamedTuple):
    """One blob to read: ``open`` checks it and returns (fd, wanted tensors, close)."""

    open: Callable[[], tuple[int, list[Want], Callable[[], None]]]


class _Filled(NamedTuple):
    job: int
    slot: int
    pos: int  # file offset of the slot's first byte
    n: int


Chunks = dict[int, list[tuple[int, int, mx.array]]]  # job -> (file pos, bytes, device array)


def stage(
    ring: Ring, jobs: list[Job], progress: Progress | None = None
) -> list[tuple[Want, mx.array]]:
    """Every wanted tensor of ``jobs`` and a device array of it in its stored shape, verified.

    Returned in job order, each job's tensors in its order; the first error
    stops the readers and is raised once they have stopped.
    """
    with ring.lock:
        abort = threading.Event()
        filled: queue.Queue[_Filled] = queue.Queue()
        pool = ThreadPoolExecutor(min(READERS, max(1, len(jobs))), "persist-stage")
        try:
            futures = [
                pool.submit(_read_job, ring, job, i, filled, abort) for i, job in enumerate(jobs)
            ]
            chunks = _copy_loop(ring, futures, filled, abort, progress)
        except BaseException:
            abort.set()
            pool.shutdown(wait=True)
            mx.synchronize()  # no copy reads a slot any more: all of them are free again
            ring.reset()
            raise
        pool.shutdown(wait=True)
        wants = [f.result() for f in futures]
    return [(w, _cut(w, chunks[i])) for i, ws in enumerate(wants) for w in ws]


def _copy_loop(
    ring: Ring,
    futures: list[Future[list[Want]]],
    filled: queue.Queue[_Filled],
    abort: threading.Event,
    progress: Progress | None,
) -> Chunks:
    """The caller's thread: copy each filled slot to the device, free slots behind it."""
    chunks: Chunks = {i: [] for i in range(len(futures))}
    inflight: deque[tuple[int, mx.array]] = deque()

    def settle(keep: int) -> None:
        while len(inflight) > keep:
            slot, arr = inflight.popleft()
            mx.eval(arr)  # its copy is done: the slot may be refilled
            ring.release(slot)

    reported = 0
    while True:
        try:
            f = filled.get(timeout=0.001 if inflight else 0.02)
        except queue.Empty:
            settle(0)  # the readers wait on slots or the disk: free every slot
            done = sum(fut.done() for fut in futures)
            if progress is not None and done > reported:
                reported = done
                progress(done, len(futures))
            if any(fut.done() and fut.exception() is not None for fut in futures):
                abort.set()
            if done == len(futures) and filled.empty():
                break
            continue
        arr = ring.to_device(f.slot, f.n)
        inflight.append((f.slot, arr))
        chunks[f.job].append((f.pos, f.n, arr))
        settle(len(ring.slots) // 2)
    settle(0)
    if progress is not None and reported < len(futures):
        progress(len(futures), len(futures))
    return chunks


def _read_job(
    ring: Ring, job: Job, i: int, filled: queue.Queue[_Filled], abort: threading.Event
) -> list[Want]:
    """A reader thread: one blob's wanted tensors into slots, each tensor hashed."""
    if abort.is_set():
        return []
    fd, wants, close = job.open()
    try:
        for run in _runs(wants):
            _read_run(ring, fd, run, i, filled, abort)
        return wants
    finally:
        close()


def _runs(wants: list[Want]) -> list[list[Want]]:
    """Wanted tensors grouped into runs of (nearly) adjacent file bytes."""
    runs: list[list[Want]] = []
    for w in sorted(wants, key=lambda w: w.start):
        if w.end == w.start:
            continue
        if runs and w.start - runs[-1][-1].end <= GAP:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def _read_run(
    ring: Ring,
    fd: int,
    run: list[Want],
    job: int,
    filled: queue.Queue[_Filled],
    abort: threading.Event,
) -> None:
    pos, end = run[0].start, run[-1].end
    hashers = {w.key: xxhash.xxh3_128() for w in run}
    while pos < end:
        slot = ring.acquire(abort)
        if slot is None:
            return
        n = min(ring.slot_bytes, end - pos)
        view = memoryview(ring.slots[slot]).cast("B")[:n]  # type: ignore[arg-type]
        try:
            if os.preadv(fd, [view], pos) != n:
                raise CorruptBlobError(run[0].where, "file truncated inside a tensor")
            for w in run:  # hash while the bytes are in the slot (and the CPU's cache)
                a, b = max(w.start, pos), min(w.end, pos + n)
                if a < b:
                    hashers[w.key].update(view[a - pos : b - pos])
                if pos < w.end <= pos + n and hashers[w.key].digest() != w.want:
                    raise CorruptBlobError(w.where, "checksum mismatch in tensor data")
        except BaseException:
            ring.release(slot)
            raise
        filled.put(_Filled(job, slot, pos, n))
        pos += n


def _cut(w: Want, chunks: list[tuple[int, int, mx.array]]) -> mx.array:
    """Tensor ``w`` from its job's device chunks, in its stored dtype and shape."""
    dtype = NAME_TO_MX[w.stored.dtype]
    if w.end == w.start:
        return mx.zeros(w.stored.shape, dtype=dtype)
    parts = [
        arr[max(w.start, pos) - pos : min(w.end, pos + n) - pos]
        for pos, n, arr in sorted(chunks, key=lambda c: c[0])
        if pos < w.end and w.start < pos + n
    ]
    first = next(pos for pos, n, _ in chunks if pos <= w.start < pos + n)
    if len(parts) > 1:
        flat = mx.concatenate(parts)
    elif (w.start - first) % DTYPE_SIZES[w.stored.dtype]:
        flat = device_copy(parts[0])  # an unaligned view: a buffer of its own first
    else:
        flat = parts[0]
    return flat.view(dtype).reshape(w.stored.shape)


def assemble(
    parts: list[tuple[int, mx.array]], shape: tuple[int, ...], axis: int, limit: int | None
) -> mx.array:
    """One buffer of ``shape`` from pieces placed at positions along ``axis``;
    positions no piece fills, and those from ``limit`` on, are zeros."""
    if len(shape) <= axis:
        return device_copy(parts[0][1])
    dtype = parts[0][1].dtype
    end = shape[axis] if limit is None else min(limit, shape[axis])
    out: list[mx.array] = []
    pos = 0

    def zeros(n: int) -> mx.array:
        return mx.zeros((*shape[:axis], n, *shape[axis + 1 :]), dtype=dtype)

    for at, p in sorted(parts, key=lambda q: q[0]):
        take = max(0, min(p.shape[axis], end - at))
        if not take:
            continue
        if at > pos:
            out.append(zeros(at - pos))
        if take < p.shape[axis]:
            p = p[(slice(None),) * axis + (slice(0, take),)]
        out.append(p)
        pos = at + take
    if pos < shape[axis]:
        out.append(zeros(shape[axis] - pos))
    if len(out) == 1:
        return device_copy(out[0])  # a buffer of its own, not a view of a chunk
    return mx.concatenate(out, axis=axis)
