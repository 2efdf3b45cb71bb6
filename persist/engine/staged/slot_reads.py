"""How a staged restore fills its lanes' slots (``engine/staged/restore``): each slot's
file bytes read and every tensor's share of them checked, before the slot is
copied on (``land``).

Two ways.  A lane with a reader process (``cuda/readers``) hands it each
slot: the request for the next slot is sent before the answer for the one
before is awaited and that slot copied on, so the worker reads while the
thread queues copies.  A lane without one reads here, on its thread, as a
worker does (``reader_worker.fill``): about ``PIECE`` bytes at a time, each
piece hashed right after, while it is still in the core's cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ...cuda import reader_worker
from ...cuda.pinned import Lane, Placed
from ...cuda.readers import Piece
from ...errors import CorruptBlobError
from ...records import TensorSpec

__all__ = ["Want", "Slot", "PIECE", "read_here", "read_in_worker"]

PIECE = 1 << 20  # bytes read before they are hashed: within a core's L2 cache


class Want(NamedTuple):
    """A stored tensor to take from a blob: its bytes [start, end) in the file."""

    key: str
    start: int
    end: int
    stored: TensorSpec
    at: int  # first position along the key's axis it fills
    want: bytes  # its checksum
    where: str


class Slot(NamedTuple):
    """One slot of a task: lane slot ``slot`` holds bytes [pos, pos + n) of file
    ``fd``, of which ``pieces`` are tensors' (slot bytes [a, b)); once checked it
    lands at offset ``off`` of staging chunk ``chunk`` and its ``placed`` pieces
    are noted.  ``fresh``: the first slot of a task (no tensor continues into
    it); ``done``: the task ends with it (whatever staging noted to tell)."""

    slot: int
    n: int
    pos: int
    chunk: int
    off: int
    pieces: list[tuple[Want, int, int]]
    placed: list[Placed]
    fd: int
    fresh: bool
    done: Any


Land = Callable[[Slot], None]  # the slot's copy queued, its pieces noted


def read_here(lane: Lane, slots: Iterator[Slot], land: Land) -> None:
    """Fill each slot on this thread, then land it."""
    hashers: dict[str, Any] = {}  # tensors that span slots
    for s in slots:
        if s.fresh:
            hashers.clear()
        view = memoryview(lane.slots[s.slot]).cast("B")[: s.n]  # type: ignore[arg-type]
        _fill(view, s, hashers)
        land(s)


def read_in_worker(lane: Lane, slots: Iterator[Slot], land: Land) -> None:
    """Each slot asked of the lane's reader process one slot ahead: the next
    request goes out before the last answer is awaited."""
    send, answer = lane.send, lane.answer  # type: ignore[attr-defined]
    pending: tuple[Any, Slot] | None = None
    try:
        for s in slots:  # the next slot: its previous copy is done
            pieces = [_piece(w, a, b, s.pos) for w, a, b in s.pieces]
            # pending first: if the last answer fails, this request is still drained
            sent = send(s.slot, s.fd, pos=s.pos, n=s.n, pieces=pieces, fresh=s.fresh)
            last, pending = pending, (sent, s)
            if last is not None:
                answer(last[0])
                land(last[1])
        if pending is not None:
            last, pending = pending, None
            answer(last[0])
            land(last[1])
    finally:
        if pending is not None:  # an error left a request with the worker: its answer is
            with contextlib.suppress(Exception):  # read, or the worker is killed
                answer(pending[0])


def _piece(w: Want, a: int, b: int, pos: int) -> Piece:
    # a tensor's file offset names it: unique in its blob, the same in every slot
    return Piece(
        a=a,
        b=b,
        ident=w.start,
        first=a + pos == w.start,
        last=b + pos == w.end,
        digest=w.want,
        where=w.where,
    )


def _fill(view: memoryview, s: Slot, hashers: dict[str, Any]) -> None:
    """The slot's bytes [0, n) from file offset ``pos``, checked as a reader process
    checks them (``reader_worker.fill``, PIECE bytes a read)."""
    pos = s.pos
    checks = [
        (a, b, w.key, int(a + pos == w.start) | 2 * int(b + pos == w.end), w.want)
        for w, a, b in s.pieces
    ]
    got = reader_worker.fill(
        view, s.fd, at=0, lo=0, hi=s.n, pos=pos, pieces=checks, hashers=hashers, piece=PIECE
    )
    if got == reader_worker.SHORT:
        where = s.pieces[-1][0].where if s.pieces else "blob"
        raise CorruptBlobError(where, "file truncated inside a tensor")
    if got is not None:
        bad = next(w for w, _, _ in s.pieces if w.key == got)
        raise CorruptBlobError(bad.where, "checksum mismatch in tensor data")
