"""A restore on MLX's CUDA backend: blobs through pinned lanes into device buffers.

The caller first makes every tensor's final, capacity-sized buffer in device
memory (``Ring.buffers``: zeroed, address known); ``stage`` adds a staging
buffer as large as the bytes it will read.  One reader thread per lane (kept
by the ring) opens and checks each blob as the host path does and walks its
wanted tensors slot by slot through the lane's two page-locked slots: each
slot filled and every tensor's share of it hashed (by the lane's reader
process, or on the thread: ``engine/slot_reads``), then copied whole into the
next free region of the staging buffer while the other slot fills.  No MLX
call runs while the readers run: the caller's thread only waits.  Then one
kernel (``Ring.scatter``) moves every tensor's bytes to their places: a
token block's rows land strided in the capacity-sized buffer, as the host
path's scatter read places them (``placement``).

Why not copy each tensor straight to its place: a copy per tensor is a
driver call per 512 KiB, and on an H200 the threads' Python around those
calls (the GIL handed back and forth) cost more than the reading.  Host
memory above the cache: the lanes' slots; device memory: the staging buffer
until the scatter is done.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import NamedTuple

from ..errors import CorruptBlobError
from ..format.pinned import Lane, Placed, Ring, settle
from ..records import DTYPE_SIZES, Progress
from . import slot_reads
from .slot_reads import Slot, Want

__all__ = ["Want", "Job", "Dest", "Copy", "Geometry", "stage", "busy", "geometry", "placement"]

GAP = 4096  # wanted tensors this close in a file are read as one run (the gap is skipped)


class Job(NamedTuple):
    """One blob to read: ``open`` checks it and returns (fd, wanted tensors, close)."""

    open: Callable[[], tuple[int, list[Want], Callable[[], None]]]


class Dest(NamedTuple):
    """A tensor's device buffer: its address, (capacity) shape, token axis, the
    position from which it stays zero (a partial hit's room), bytes per element."""

    addr: int
    shape: tuple[int, ...]
    axis: int
    limit: int | None
    item: int


class Copy(NamedTuple):
    """``height`` rows of ``width`` bytes from offset ``src`` of a staging buffer
    (rows ``spitch`` apart) to address ``dst`` (rows ``dpitch`` apart): what
    ``placement`` makes of a piece, as host memmoves do it where no kernel runs."""

    src: int
    dst: int
    width: int
    height: int
    spitch: int
    dpitch: int


class Geometry(NamedTuple):
    """Where a stored piece's bytes go: row r of ``row`` bytes to ``dst + r * pitch``,
    of which the first ``keep`` bytes are kept."""

    dst: int
    row: int
    pitch: int
    keep: int


def geometry(stored: tuple[int, ...], at: int, dest: Dest) -> Geometry:
    """The rows of a piece stored with shape ``stored`` that fills ``dest`` from ``at``.

    ValueError unless the piece fits its buffer (every dimension but the token
    axis equal): a header's shape is never trusted to place bytes."""
    axis, shape = dest.axis, tuple(dest.shape)
    fits = len(stored) == len(shape) and at >= 0
    if fits and len(stored) <= axis:
        fits = tuple(stored) == shape and at == 0
    elif fits:
        fits = all(a == b for i, (a, b) in enumerate(zip(stored, shape, strict=True)) if i != axis)
    if not fits:
        raise ValueError(f"a piece of shape {list(stored)} at {at} does not fit {list(shape)}")
    size = math.prod(stored) * dest.item
    if len(stored) <= axis:  # no token axis: the tensor is its whole buffer
        return Geometry(dest.addr, size, size, size)
    inner = math.prod(stored[axis + 1 :]) * dest.item
    row, pitch = stored[axis] * inner, dest.shape[axis] * inner
    end = dest.shape[axis] if dest.limit is None else min(dest.limit, dest.shape[axis])
    keep = max(0, min(stored[axis], end - at)) * inner
    if row == pitch == keep:  # rows that follow each other: one row
        return Geometry(dest.addr, size, size, size)
    return Geometry(dest.addr + at * inner, row, pitch, keep)


def placement(p: Placed) -> list[Copy]:
    """The copies that put a staged piece in place (what ``Ring.scatter`` does on
    the device, as strided row copies): whole rows in one strided copy, partial
    rows each alone."""
    a, b, src = p.a, p.b, p.src
    g = Geometry(p.dst, p.row, p.pitch, p.keep)
    out: list[Copy] = []
    pos = a
    while pos < b:
        r, c = divmod(pos, g.row)
        if c == 0 and b - pos >= g.row:
            rows = (b - pos) // g.row
            width = min(g.row, g.keep)
            if width:
                out.append(Copy(src + pos - a, g.dst + r * g.pitch, width, rows, g.row, g.pitch))
            pos += rows * g.row
            continue
        end = min(b, (r + 1) * g.row)
        hi = min(end - r * g.row, g.keep)
        if c < hi:
            out.append(Copy(src + pos - a, g.dst + r * g.pitch + c, hi - c, 1, hi - c, hi - c))
        pos = end
    return out


CHUNK = 1 << 30  # bytes of one staging buffer (MLX's shapes are 32-bit)


class _Staging:
    """Device staging buffers, handed out to the readers a slot's worth at a time,
    and the copies out of each."""

    def __init__(self, ring: Ring, jobs: int, keys: int, total: int) -> None:
        slot = ring.slot_bytes
        # regions start 16-aligned (the scatter's wide path); a slot never straddles
        need = total + 16 * (total // slot + jobs * max(1, keys) + 1)
        if need <= CHUNK:
            sizes = [need]
        else:
            n = -(-need // (CHUNK - slot))
            sizes = [CHUNK] * (n - 1) + [need - (n - 1) * (CHUNK - slot) + slot]
        self.bufs = ring.buffers(sizes)
        self.sizes = sizes
        self.placed: list[list[Placed]] = [[] for _ in sizes]
        self.lock = threading.Lock()
        self.chunk = self.used = 0

    def region(self, n: int) -> tuple[int, int]:
        """(chunk, offset) of ``n`` free bytes."""
        with self.lock:
            off = -(-self.used // 16) * 16
            if off + n > self.sizes[self.chunk]:
                self.chunk, off = self.chunk + 1, 0
            self.used = off + n
            return self.chunk, off

    def add(self, chunk: int, placed: list[Placed]) -> None:
        with self.lock:
            self.placed[chunk] += placed


_here = threading.local()  # this thread's staged restore, if one runs


def busy() -> bool:
    """Is this thread inside a staged restore (its progress callback restoring
    again)?  Then that restore takes the host path: the lanes are the outer one's."""
    return bool(getattr(_here, "busy", False))


def stage(
    ring: Ring,
    jobs: list[Job],
    dests: dict[str, Dest],
    total: int,
    progress: Progress | None = None,
) -> None:
    """Read every wanted tensor of ``jobs`` (at most ``total`` bytes of them) into
    its ``dests`` buffer, verified.

    Returns once every byte is in place.  The first error stops the readers and
    is raised once they have stopped and their copies are done (nothing reads a
    slot or writes a buffer after it).
    """
    with ring.lock:
        _here.busy = True
        try:
            _stage(ring, jobs, dests, total, progress)
        finally:
            _here.busy = False


def _stage(
    ring: Ring, jobs: list[Job], dests: dict[str, Dest], total: int, progress: Progress | None
) -> None:
    staged = _Staging(ring, len(jobs), len(dests), total)
    abort = threading.Event()
    lanes: queue.Queue[Lane] = queue.Queue()
    for lane in ring.lanes:
        lanes.put(lane)
    pool = ring.pool()
    futures: list[Future[None]] = []
    try:  # a Ctrl-C between two submits still settles the jobs already submitted
        for job in jobs:
            futures.append(pool.submit(_read_job, lanes, job, dests, staged, abort))
        _wait(futures, progress)
    except KeyboardInterrupt:
        abort.set()
        if ring.readers is not None:
            ring.readers.interrupt()  # no reader thread stays waiting on a worker
        raise
    except BaseException:
        abort.set()
        raise
    finally:
        settle(futures, ring)
    while staged.bufs:  # each staging chunk goes as soon as its pieces are placed
        (buf, _), placed = staged.bufs.pop(0), staged.placed.pop(0)
        if placed:
            ring.scatter(buf, placed)


def _wait(futures: list[Future[None]], progress: Progress | None) -> None:
    """Block (the GIL released) until every reader is done; the first error in
    job order among those that failed is raised."""
    pending = set(futures)
    while pending:
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if progress is not None:
            progress(len(futures) - len(pending), len(futures))


def _read_job(
    lanes: queue.Queue[Lane],
    job: Job,
    dests: dict[str, Dest],
    staged: _Staging,
    abort: threading.Event,
) -> None:
    """A reader thread: one blob's wanted tensors through a lane, each tensor hashed."""
    if abort.is_set():
        return
    lane = lanes.get()
    try:
        lane.enter()
        fd, wants, close = job.open()
        try:
            for run in _runs(wants):
                _read_run(lane, fd, run, dests, staged, abort)
        finally:
            close()
    except BaseException:
        abort.set()  # the other readers stop at their next slot
        raise
    finally:
        lanes.put(lane)


def _placed(w: Want, dest: Dest) -> Geometry:
    """Where ``w`` goes, once its stored dtype and shape are known to fit its buffer."""
    if DTYPE_SIZES[w.stored.dtype] != dest.item:
        raise CorruptBlobError(w.where, f"dtype {w.stored.dtype} does not fit its buffer")
    try:
        return geometry(tuple(w.stored.shape), w.at, dest)
    except ValueError as e:
        raise CorruptBlobError(w.where, str(e)) from None


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
    lane: Lane,
    fd: int,
    run: list[Want],
    dests: dict[str, Dest],
    staged: _Staging,
    abort: threading.Event,
) -> None:
    """One run of adjacent tensors through the lane's slots (``engine/slot_reads``):
    each slot filled and checked, then copied whole to the staging buffer."""
    slots = _slots(lane, run, {w.key: _placed(w, dests[w.key]) for w in run}, staged, abort)

    def land(s: Slot) -> None:
        lane.put(s.slot, staged.bufs[s.chunk][1] + s.off, s.n)
        staged.add(s.chunk, s.placed)

    if getattr(lane, "send", None) is None:
        slot_reads.read_here(lane, fd, slots, land, run[0].where)
    else:
        slot_reads.read_in_worker(lane, fd, slots, land)


def _slots(
    lane: Lane,
    run: list[Want],
    where: dict[str, Geometry],
    staged: _Staging,
    abort: threading.Event,
) -> Iterator[Slot]:
    """The run's slots, each taken from the lane (its previous copy done) when asked
    for, with the tensors it holds and where their bytes go.  The least Python per
    tensor: every line here holds the GIL the other readers wait for."""
    pos, end = run[0].start, run[-1].end
    first = 0
    while pos < end and not abort.is_set():
        slot = lane.take()
        n = min(int(lane.slots[slot].nbytes), end - pos)
        chunk, off = staged.region(n)
        while run[first].end <= pos:  # tensors wholly before this slot: done
            first += 1
        placed: list[Placed] = []
        pieces: list[tuple[Want, int, int]] = []  # slot bytes [a, b) of each tensor
        for w in run[first:]:  # only the tensors this slot holds (a run is sorted)
            if w.start >= pos + n:
                break
            a, b = max(w.start, pos) - pos, min(w.end, pos + n) - pos
            pieces.append((w, a, b))
            placed.append(Placed(off + a, a + pos - w.start, b + pos - w.start, *where[w.key]))
        yield Slot(slot, n, pos, chunk, off, pieces, placed)
        pos += n
