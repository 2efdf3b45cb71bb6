"""The work a staged restore's lanes share (``engine/staged/restore``): every blob cut
into tasks of about one slot of adjacent tensors, handed to whichever lane
asks next.

Why tasks and not whole blobs: a lane that owned a blob kept it to the end,
so the lanes finished up to a blob apart (32 MiB, a quarter of a lane's share
of an 8k Llama-3-8B restore), and each lane's reader waited while its thread
opened the next blob.  Tasks start and end at tensor boundaries, so a tensor's
running hash never crosses lanes; a lane asks for its next task while its
reader still reads the last one, and blobs are opened ahead, by whichever
lane finds the queue short (``Work.take``).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from ...cuda.pinned import Lane, Placed
from .slot_reads import Slot, Want

__all__ = ["Job", "Task", "Work", "tasks", "task_slots", "GAP"]

GAP = 4096  # wanted tensors this close in a file are read as one run (the gap is skipped)

Where = tuple[int, int, int, int]  # a tensor's (dst, row, pitch, keep): staging.Geometry


class Job(NamedTuple):
    """One blob to read: ``open`` checks it and returns (fd, wanted tensors, close)."""

    open: Callable[[], tuple[int, list[Want], Callable[[], None]]]


class OpenBlob:
    """A blob's descriptor, open until the last of its ``left`` tasks has landed."""

    def __init__(self, fd: int, close: Callable[[], None], left: int) -> None:
        self.fd, self.close, self.left = fd, close, left


class Task(NamedTuple):
    """Adjacent tensors of one blob (sorted, file bytes ``wants[0].start`` to
    ``wants[-1].end``) read by one lane, and where each one's bytes go."""

    blob: OpenBlob
    wants: list[Want]
    where: dict[str, Where]


def tasks(wants: list[Want], size: int) -> list[list[Want]]:
    """``wants`` (empty tensors left out) cut into tasks: runs of tensors at most
    GAP bytes apart, each cut where the next tensor would take it past ``size``
    bytes; a tensor larger than ``size`` is a task of its own."""
    out: list[list[Want]] = []
    for w in sorted(wants, key=lambda w: w.start):
        if w.end == w.start:
            continue
        if out and w.start - out[-1][-1].end <= GAP and w.end - out[-1][0].start <= size:
            out[-1].append(w)
        else:
            out.append([w])
    return out


class Work:
    """The tasks of ``jobs``, opened a blob at a time as the lanes ask (``take``),
    about ``ahead`` tasks kept ready; ``events`` gets 1 per blob done and None
    per lane done, for the thread that waits."""

    def __init__(
        self, jobs: list[Job], place: Callable[[Want], Where], size: int, ahead: int
    ) -> None:
        self.jobs, self.place, self.size, self.ahead = jobs, place, size, ahead
        self.next = self.opening = 0
        self.ready: deque[Task] = deque()
        self.open: list[OpenBlob] = []  # not yet closed: closed by close_all after an error
        self.lock = threading.Lock()
        self.opener = threading.Lock()  # one lane opens at a time; the others read
        self.events: queue.Queue[int | None] = queue.Queue()

    def take(self) -> Task | None:
        """The next task, or None when every job's tasks are handed out."""
        while True:
            with self.lock:
                task = self.ready.popleft() if self.ready else None
                more = self.next < len(self.jobs)
                if task is None and not more and self.opening == 0:
                    return None
            if more and (task is None or len(self.ready) < self.ahead):
                if self.opener.acquire(blocking=task is None):
                    try:
                        self._open_next()
                    finally:
                        self.opener.release()
            elif task is None:  # another lane is opening the last job: wait for it
                with self.opener:
                    pass
            if task is not None:
                return task

    def _open_next(self) -> None:
        with self.lock:
            if self.next >= len(self.jobs):
                return
            job = self.jobs[self.next]
            self.next += 1
            self.opening += 1
        try:
            fd, wants, close = job.open()
            try:
                cut = tasks(wants, self.size)
                blob = OpenBlob(fd, close, len(cut))
                made = [Task(blob, t, {w.key: self.place(w) for w in t}) for t in cut]
            except BaseException:
                close()
                raise
            with self.lock:
                if made:
                    self.open.append(blob)
                    self.ready.extend(made)
            if not made:
                close()
                self.events.put(1)
        finally:
            with self.lock:
                self.opening -= 1

    def landed(self, blob: OpenBlob) -> None:
        """One task of ``blob`` landed: the blob is closed with its last."""
        with self.lock:
            blob.left -= 1
            if blob.left:
                return
            self.open.remove(blob)
        blob.close()
        self.events.put(1)

    def close_all(self) -> None:
        """Close what an error or a Ctrl-C left open (the lanes have stopped)."""
        with self.lock:
            left, self.open = self.open, []
        for blob in left:
            blob.close()


def task_slots(
    lane: Lane, work: Work, region: Callable[[int], tuple[int, int]], abort: threading.Event
) -> Iterator[Slot]:
    """A lane's slots, task after task, each taken from the lane (its previous copy
    done) when asked for, with the tensors it holds and where their bytes go.
    The least Python per tensor: every line here holds the GIL the other lanes
    wait for."""
    while not abort.is_set():
        task = work.take()
        if task is None:
            return
        run, where, blob = task.wants, task.where, task.blob
        pos, end, first, fresh = run[0].start, run[-1].end, 0, True
        while pos < end and not abort.is_set():
            slot = lane.take()
            n = min(int(lane.slots[slot].nbytes), end - pos)
            chunk, off = region(n)
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
            done = blob if pos + n >= end else None
            yield Slot(
                slot=slot,
                n=n,
                pos=pos,
                chunk=chunk,
                off=off,
                pieces=pieces,
                placed=placed,
                fd=blob.fd,
                fresh=fresh,
                done=done,
            )
            pos, fresh = pos + n, False
