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


Chunk = tuple[int, int, mx.array]  # file pos, bytes, device array
IN_FLIGHT = 2  # copies launched and not yet waited for: the rest of the ring is the readers'


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
            cut = _Copier(ring, futures, filled, abort, progress).run()
            pool.shutdown(wait=True)
            for f in futures:
                f.result()  # the first reader's error, in job order
        except BaseException:
            abort.set()
            pool.shutdown(wait=True)
            mx.synchronize()  # no copy reads a slot any more: all of them are free again
            ring.reset()
            raise
    return [pair for i in range(len(jobs)) for pair in cut[i]]


class _Copier:
    """The caller's thread: copy each filled slot to the device, free slots behind
    it, and cut each finished blob's tensors from its chunks while the readers go on."""

    def __init__(
        self,
        ring: Ring,
        futures: list[Future[tuple[list[Want], int]]],
        filled: queue.Queue[_Filled],
        abort: threading.Event,
        progress: Progress | None,
    ) -> None:
        self.ring, self.futures, self.filled, self.abort = ring, futures, filled, abort
        self.progress = progress
        self.chunks: dict[int, list[Chunk]] = {i: [] for i in range(len(futures))}
        self.done: dict[int, list[Want]] = {}  # blobs read whole: their wanted tensors
        self.inflight: deque[tuple[int, mx.array]] = deque()

    def settle(self, keep: int) -> None:
        done = [self.inflight.popleft() for _ in range(len(self.inflight) - keep)]
        if not done:
            return
        mx.eval([arr for _, arr in done])
        # the copy kernel reads each slot by address, unseen by MLX's graph: only a
        # finished stream proves it read every byte before a reader refills it (one
        # wait for every slot settled here, not one per slot)
        mx.synchronize()
        for slot, _ in done:
            self.ring.release(slot)

    def run(self) -> dict[int, list[tuple[Want, mx.array]]]:
        # While the readers run this thread only launches copies and frees slots:
        # any more Python here holds the GIL the readers need between their reads
        # and hashes (a busy thread beside 8 readers made them 25x slower on an H200).
        while len(self.done) < len(self.futures):
            try:
                f = self.filled.get(timeout=0.001 if self.inflight else 0.02)
            except queue.Empty:
                self.settle(0)  # the readers wait on slots or the disk: free every slot
                self.finish()
                continue
            arr = self.ring.to_device(f.slot, f.n)
            self.inflight.append((f.slot, arr))
            self.chunks[f.job].append((f.pos, f.n, arr))
            self.settle(IN_FLIGHT)
            self.finish()
        self.settle(0)
        if self.abort.is_set():
            return {i: [] for i in self.done}
        return {i: [(w, _cut(w, self.chunks[i])) for w in wants] for i, wants in self.done.items()}

    def finish(self) -> None:
        """Note the blobs whose reader is done and whose chunks all arrived."""
        for i, fut in enumerate(self.futures):
            if i in self.done or not fut.done():
                continue
            if fut.exception() is not None:
                self.abort.set()  # the other readers stop; stage raises this error
            if self.abort.is_set():
                self.done[i] = []
                continue
            wants, n = fut.result()
            if len(self.chunks[i]) == n:
                self.done[i] = wants
                if self.progress is not None:
                    self.progress(len(self.done), len(self.futures))


def _read_job(
    ring: Ring, job: Job, i: int, filled: queue.Queue[_Filled], abort: threading.Event
) -> tuple[list[Want], int]:
    """A reader thread: one blob's wanted tensors into slots, each tensor hashed.
    Returns them and how many chunks it handed on."""
    if abort.is_set():
        return [], 0
    fd, wants, close = job.open()
    try:
        return wants, sum(_read_run(ring, fd, run, i, filled, abort) for run in _runs(wants))
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
) -> int:
    """One run of adjacent tensors into slots, each slot read whole and each tensor's
    share of it hashed there (python-xxhash lets the other readers run meanwhile)."""
    pos, end = run[0].start, run[-1].end
    chunks = first = 0
    hashers = {w.key: xxhash.xxh3_128() for w in run}
    while pos < end:
        slot = ring.acquire(abort)
        if slot is None:
            return chunks
        n = min(ring.slot_bytes, end - pos)
        view = memoryview(ring.slots[slot]).cast("B")[:n]  # type: ignore[arg-type]
        try:
            if os.preadv(fd, [view], pos) != n:
                raise CorruptBlobError(run[0].where, "file truncated inside a tensor")
            while run[first].end <= pos:  # tensors wholly before this slot: done
                first += 1
            for w in run[first:]:  # only the tensors this slot holds (a run is sorted)
                if w.start >= pos + n:
                    break
                a, b = max(w.start, pos), min(w.end, pos + n)
                if a < b:
                    hashers[w.key].update(view[a - pos : b - pos])
                if w.end <= pos + n and hashers[w.key].digest() != w.want:
                    raise CorruptBlobError(w.where, "checksum mismatch in tensor data")
        except BaseException:
            ring.release(slot)
            raise
        filled.put(_Filled(job, slot, pos, n))
        chunks += 1
        pos += n
    return chunks


def _cut(w: Want, chunks: list[Chunk]) -> mx.array:
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
