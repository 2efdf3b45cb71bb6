"""The blobs of one save: every block hashed in full (on threads), and written
only when no live blob holds the same bytes, WRITERS at a time.

Step 6 of ARCHITECTURE.md's save path, for ``saving.write_and_commit``: every
blob is on disk (fsynced, renamed) before it returns, and listed in ``written``
so a failed save removes it.  The commit that references them is the caller's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..format.container import write_tensors
from ..format.manifest import blob_metadata
from ..records import Progress
from ..storage.blobs import BlobStore
from ..storage.index import BlockRef, Index, NewBlob
from ..yielding import pause
from .blocks import Parts, Piece, Plan, content_key, materialize

__all__ = ["HASHERS", "WRITERS", "write_blobs"]

WRITERS = 2  # blobs written at once (one fsyncs while the other writes)
HASHERS = min(4, os.cpu_count() or 1)  # blocks hashed at once (xxhash drops the GIL)
AHEAD = 2 * HASHERS  # blocks hashed ahead of the one being written
T = TypeVar("T")
Hashed = list[tuple[Piece, Parts, bytes]]  # ``blocks.materialize``


def write_blobs(
    index: Index,
    blobs: BlobStore,
    p: Plan,
    *,
    chs: list[bytes],
    secret: bytes,
    block_tokens: int,
    written: list[NewBlob],
    progress: Progress | None,
    salt: str,
) -> tuple[list[BlockRef], str]:
    refs = []
    n = p.n_tokens
    blocks = n // block_tokens
    writes = _Writes(blobs, salt, written)
    # Hashing every byte is most of a turn's save (the blocks unchanged since
    # the last one are found by it): on threads, ahead of the lookups and writes.
    hashing = ThreadPoolExecutor(HASHERS, thread_name_prefix="persist-hash")
    try:
        hashed = _ahead(hashing, lambda i: materialize(p.block_pieces(i)), blocks if p.split else 0)
        for i in range(blocks):
            pause()  # persist serve's write-behind waits here while a request prompts
            mats = next(hashed) if p.split else []
            blob = _put(index, secret, b"block", mats, writes) if mats else None
            refs.append(BlockRef(i, chs[i + 1], blob))
            if progress is not None:
                progress(i + 1, blocks + 1)
        tail = _put(index, secret, b"tail", materialize(p.tail_pieces(n)), writes)
        hashing.shutdown(wait=True)
        writes.close()  # every blob on disk (fsynced, renamed) before the commit
    except BaseException:
        with contextlib.suppress(BaseException):  # the first error is the one to report
            writes.abandon()  # every write ended and listed: the caller removes them
        hashing.shutdown(wait=True, cancel_futures=True)
        raise
    if progress is not None:
        progress(blocks + 1, blocks + 1)
    return refs, tail


def _ahead(pool: ThreadPoolExecutor, fn: Callable[[int], T], n: int) -> Iterator[T]:
    """``fn(0) .. fn(n - 1)`` on ``pool``, in order, at most ``AHEAD`` submitted beyond
    the one taken: a ``pause()`` of the taker holds the hashing too (``pool.map``
    submitted a whole cache's blocks at once, and they ran beside a request's prefill)."""
    running: deque[Future[T]] = deque()
    submitted = 0
    for _ in range(n):
        while submitted < n and len(running) < AHEAD:
            running.append(pool.submit(fn, submitted))
            submitted += 1
        yield running.popleft().result()


@dataclass(eq=False)
class _Job:
    """One blob's write: queued, then taken by a writer thread (running) or dropped
    by a failed save before any thread took it (cancelled)."""

    key: str
    write: Any
    size_hint: int
    state: str = "queued"  # -> "running" | "cancelled"
    done: threading.Event = field(default_factory=threading.Event)  # set once it ran
    error: BaseException | None = None


class _Writes:
    """The blob writes of one save, WRITERS at a time: one blob is fsynced while
    the next is written.  Each write lists its blob in ``written`` itself, from its
    thread, so a failed save removes it.  A Ctrl-C can land anywhere on the save's
    thread (attack r15): inside ``submit`` (the write queued, its future lost), or in
    a thread join, after which Python 3.11 takes a running thread for ended.  So the
    save waits on each write's own event, and a failed save cancels the writes no
    thread has taken yet instead of waiting for them."""

    def __init__(self, blobs: BlobStore, salt: str, written: list[NewBlob]) -> None:
        self.blobs, self.salt, self.written = blobs, salt, written
        self.pool = ThreadPoolExecutor(WRITERS, thread_name_prefix="persist-write")
        self.lock = threading.Lock()
        self.jobs: list[_Job] = []  # every write started
        self.running: dict[str, _Job] = {}  # started, not yet waited for

    def find(self, key: str) -> str | None:
        """The file of a blob of these bytes this save already writes."""
        if key in self.running:
            return self.blobs.file_name(key, self.salt)
        return next((b.file for b in list(self.written) if b.key == key), None)

    def start(self, key: str, write: Any, size_hint: int) -> str:
        if len(self.running) >= 2 * WRITERS:  # bounded: a few blobs' views in flight
            self._settle(next(iter(self.running)))
        job = _Job(key, write, size_hint)
        self.jobs.append(job)  # before the hand-over: a failed save finds it
        self.running[key] = job
        self.pool.submit(self._run, job)
        return self.blobs.file_name(key, self.salt)

    def _run(self, job: _Job) -> None:  # on a writer thread
        with self.lock:
            if job.state == "cancelled":
                return
            job.state = "running"
        try:
            file, size, head = self.blobs.put(job.key, job.write, job.size_hint, self.salt)
            self.written.append(NewBlob(file, job.key, size, head))  # one append: atomic
        except BaseException as e:
            job.error = e
        finally:
            job.done.set()

    def _settle(self, key: str) -> None:
        job = self.running[key]
        job.done.wait()  # interrupted: still listed, the failed save waits for it
        del self.running[key]
        if job.error is not None:
            raise job.error

    def close(self) -> None:
        """Every write done (each was handed over), then the first failure raised."""
        held = _wait_for(self.jobs)
        self.pool.shutdown(wait=False)  # its threads end once the queue is empty
        first = held or next((j.error for j in self.jobs if j.error is not None), None)
        self.running.clear()
        if first is not None:
            raise first

    def abandon(self) -> None:
        """A failed save: the writes no thread took are dropped, the running ones
        waited for (their blobs then in ``written``, for the caller to remove)."""
        with self.lock:
            for job in self.jobs:
                if job.state == "queued":
                    job.state = "cancelled"
        held = _wait_for([j for j in self.jobs if j.state == "running"])
        self.pool.shutdown(wait=False)
        self.running.clear()
        if held is not None:
            raise held


def _wait_for(jobs: list[_Job]) -> BaseException | None:
    """Wait until every job ran, whatever interrupts the wait (a Ctrl-C lands here
    most, in the last fsyncs; a few blobs at most): the first interrupt, held."""
    held: BaseException | None = None
    for job in jobs:
        while True:
            try:
                job.done.wait()
                break
            except BaseException as e:
                held = held or e
    return held


def _put(index: Index, secret: bytes, role: bytes, mats: Hashed, writes: _Writes) -> str:
    key = content_key(secret, role, mats)
    same = writes.find(key)  # the same bytes twice in one snapshot: one file
    if same is not None:
        return same
    existing = index.live_blob(key)
    if existing is not None:
        return existing[0]
    items = [(pc.key, pc.spec, (lambda runs=runs: runs)) for pc, runs, _ in mats]
    sums = {pc.key: s for pc, _, s in mats}
    meta_role = role.decode()

    def write(sink: Any) -> bytes:
        write_tensors(sink, items, lambda got: blob_metadata(meta_role, got), sums)
        return bytes(sink.head_digest)

    size_hint = sum(pc.spec.nbytes for pc, _, _ in mats)
    return writes.start(key, write, size_hint)
