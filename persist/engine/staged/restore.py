"""A restore on MLX's CUDA backend: blobs through pinned lanes into device buffers.

The caller first makes every tensor's final, capacity-sized buffer in device
memory (``Ring.buffers``: zeroed, address known); ``stage`` adds a staging
buffer as large as the bytes it will read.  One thread per lane (kept by the
ring) takes task after task (about a slot of adjacent tensors of one blob,
opened and checked as the host path does: ``engine/staged/lane_work``) and walks it
slot by slot through the lane's two page-locked slots: each slot filled and
every tensor's share of it hashed (by the lane's reader process, or on the
thread: ``engine/staged/slot_reads``), then copied whole into the next free region
of the staging buffer while the other slot fills.  No MLX
call runs while the readers run: the caller's thread only waits.  Then one
kernel (``Ring.scatter``) moves every tensor's bytes to their places: a
token block's rows land strided in the capacity-sized buffer, as the host
path's scatter read places them (``placement``).

A ring made ``direct`` (``PERSIST_STAGING=direct``, ``cuda/pinned``) skips the
staging buffer and the scatter: each slot's pieces are copied by the copy
engine straight to their rows (``Lane.place``: one strided driver copy per
piece, ``placement``), so the device holds the cache and nothing more, and no
kernel of persist's is compiled on the way (issue 39).  The staged way makes
a driver call per slot and one kernel launch in all: fewer calls where the
pieces are small.  Host memory above the cache: the lanes' slots; device
memory: the staging buffer, where there is one, until the scatter is done.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, NamedTuple

from ...cuda.pinned import Lane, Placed, Ring, data_path, settle
from ...errors import CorruptBlobError
from ...records import DTYPE_SIZES, Progress
from . import slot_reads
from .lane_work import Job, Work, task_slots
from .slot_reads import Slot, Want

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = [
    "Want", "Job", "Dest", "Copy", "Geometry", "stage", "busy", "geometry", "placement", "prepare",
    "rounds", "in_rounds",
]  # fmt: skip


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
        self.direct = ring.direct
        self.lock = threading.Lock()
        self.memo: dict[tuple[object, ...], Geometry | str] = {}  # _placed's
        self.chunk = self.used = 0
        if ring.direct:  # slots go straight to their tensors: no staging at all
            self.bufs: list[tuple[mx.array, int]] = []
            self.sizes: list[int] = []
            self.placed: list[list[Placed]] = []
            return
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
        self.placed = [[] for _ in sizes]

    def region(self, n: int) -> tuple[int, int]:
        """(chunk, offset) of ``n`` free bytes; (0, 0) where slots go straight to
        their tensors (a piece's ``src`` is then its offset in the slot)."""
        if self.direct:
            return 0, 0
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


ROUNDS = 12  # a restore's staging holds at most about 1/ROUNDS of its bytes at a time
ROUND_MIN = 64 << 20  # ... but rounds of at least this many bytes (the lanes' pipelining)
ROOM = 1.25  # whole staging only where the device has this much more free than it needs


def in_rounds(total: int) -> bool:
    """Stage in rounds?  Where the device has no room for a whole staging copy beside
    what is free now (a server whose weights and KV budget fill the GPU), or where
    PERSIST_STAGING=rounds asks.  Rounds hold the device near 1.06x the cache but
    took an 8k Llama-3-8B restore 0.14-0.17 s against 0.06 s whole on an H200
    (bench/results/cuda-first-call-r7.md): the lanes drain at every round."""
    asked = os.environ.get("PERSIST_STAGING", "")
    if asked in ("rounds", "whole"):
        return asked == "rounds"
    driver = data_path().driver
    if driver is None:
        return False
    try:
        free = driver.free_memory()
    except OSError:  # a driver that cannot say: as before
        return False
    return ROOM * total > free


def rounds(sizes: list[int], total: int) -> list[list[int]]:
    """Job indexes in rounds of about ``total / ROUNDS`` bytes (at least ROUND_MIN,
    at least one job): the device holds one round's staging at a time, so a
    restore peaks near 1 + 1/ROUNDS times the cache, not twice it (issue 39)."""
    cap = max(ROUND_MIN, -(-total // ROUNDS))
    out: list[list[int]] = [[]]
    held = 0
    for i, n in enumerate(sizes):
        if out[-1] and held + n > cap:
            out.append([])
            held = 0
        out[-1].append(i)
        held += n
    return out


def stage(
    ring: Ring,
    jobs: list[Job],
    dests: dict[str, Dest],
    total: int,
    progress: Progress | None = None,
    sizes: list[int] | None = None,
) -> None:
    """Read every wanted tensor of ``jobs`` (at most ``total`` bytes of them) into
    its ``dests`` buffer, verified.  With each job's bytes (``sizes``) and where the
    device is short of room (``in_rounds``), in rounds (``rounds``), each one's
    staging placed and freed before the next.

    Returns once every byte is in place.  The first error stops the readers and
    is raised once they have stopped and their copies are done (nothing reads a
    slot or writes a buffer after it).
    """
    whole = sizes is None or ring.direct or not in_rounds(total)
    groups = [list(range(len(jobs)))] if whole or sizes is None else rounds(sizes, total)
    with ring.for_restore():
        _here.busy = True
        try:
            done = 0
            for group in groups:
                size = total if sizes is None else sum(sizes[i] for i in group)
                told = _offset(progress, done, len(jobs))
                _stage(ring, [jobs[i] for i in group], dests, size, told)
                done += len(group)
        finally:
            _here.busy = False


def _offset(progress: Progress | None, done: int, jobs: int) -> Progress | None:
    """``progress`` told of a round's blobs as of the whole restore's."""
    if progress is None:
        return None
    return lambda n, _total: progress(done + n, jobs)


def _stage(
    ring: Ring, jobs: list[Job], dests: dict[str, Dest], total: int, progress: Progress | None
) -> None:
    staged = _Staging(ring, len(jobs), len(dests), total)
    place = lambda w: _placed(w, dests[w.key], staged.memo)  # noqa: E731
    work = Work(jobs, place, ring.slot_bytes, len(ring.lanes))
    abort = threading.Event()
    pool = ring.pool()
    futures: list[Future[None]] = []
    try:  # a Ctrl-C between two submits still settles the lanes already started
        for lane in ring.lanes:
            futures.append(pool.submit(_lane, lane, work, staged, abort))
        _wait(futures, work, len(jobs), progress)
    except KeyboardInterrupt:
        abort.set()
        if ring.readers is not None:
            ring.readers.interrupt()  # no reader thread stays waiting on a worker
        raise
    except BaseException:
        abort.set()
        raise
    finally:
        try:
            settle(futures, ring)
        finally:
            work.close_all()
    while staged.bufs:  # each staging chunk goes as soon as its pieces are placed
        (buf, _), placed = staged.bufs.pop(0), staged.placed.pop(0)
        if placed:
            ring.scatter(buf, placed)


def _wait(futures: list[Future[None]], work: Work, jobs: int, progress: Progress | None) -> None:
    """Block (the GIL released) until every lane is done, telling ``progress`` of
    each blob done on this thread; then the first error in lane order is raised."""
    lanes, blobs = len(futures), 0
    while lanes:
        if work.events.get() is None:
            lanes -= 1
        else:
            blobs += 1
            if progress is not None:
                progress(blobs, jobs)
    wait(futures)
    for f in futures:
        if f.exception() is not None:
            raise f.exception()  # type: ignore[misc]


def _lane(lane: Lane, work: Work, staged: _Staging, abort: threading.Event) -> None:
    """A lane's thread: tasks through the lane (``lane_work``) until none is left,
    each slot filled and checked (``slot_reads``), then copied whole to the
    staging buffer."""
    try:
        if abort.is_set():
            return
        lane.enter()
        slots = task_slots(lane, work, staged.region, abort)

        def land(s: Slot) -> None:
            if staged.direct:
                lane.place(s.slot, [c for p in s.placed for c in placement(p)])
            else:
                lane.put(s.slot, staged.bufs[s.chunk][1] + s.off, s.n)
                staged.add(s.chunk, s.placed)
            if s.done is not None:
                work.landed(s.done)

        if getattr(lane, "send", None) is None:
            slot_reads.read_here(lane, slots, land)
        else:
            slot_reads.read_in_worker(lane, slots, land)
    except BaseException:
        abort.set()  # the other lanes stop at their next slot
        raise
    finally:
        work.events.put(None)


def _placed(w: Want, dest: Dest, memo: dict[tuple[object, ...], Geometry | str]) -> Geometry:
    """Where ``w`` goes, once its stored dtype and shape are known to fit its buffer.

    Every layer's tensor of a block has the same shape: ``memo`` keeps each
    shape's answer relative to its buffer, so a restore works it out once."""
    stored = w.stored
    k = (stored.dtype, stored.shape, w.at, dest.shape, dest.axis, dest.limit, dest.item)
    got = memo.get(k)
    if got is None:
        if DTYPE_SIZES[stored.dtype] != dest.item:
            got = f"dtype {stored.dtype} does not fit its buffer"
        else:
            try:
                got = geometry(tuple(stored.shape), w.at, dest._replace(addr=0))
            except ValueError as e:
                got = str(e)
        memo[k] = got
    if isinstance(got, str):
        raise CorruptBlobError(w.where, got)
    return got._replace(dst=got.dst + dest.addr)


def prepare() -> bool:
    """Set up now what a process's first restore or save would: the data path (pinned
    lanes, reader processes, each lane's thread and slots: ``Ring.warm``) and, on CUDA,
    every kernel built (``kernels.warm``).
    ``persist serve`` calls this before it answers; True where the path is CUDA's."""
    chosen = data_path()
    if chosen.driver is None:
        return False
    from ...cuda import kernels

    kernels.warm(staged=chosen.ring is None or not chosen.ring.direct)
    if chosen.ring is not None:
        try:
            chosen.ring.warm()  # lane threads up, reader processes' slots mapped
        except OSError as e:  # ReaderLost too: a restore starts its workers again itself
            logging.getLogger("persist").warning("persist: the restore lanes not warmed: %s", e)
    return True
