"""How a staged restore fills its lanes' slots (``engine/staging``): each slot's
file bytes read and every tensor's share of them checked, before the slot is
copied on (``land``).

Two ways.  A lane with a reader process (``format/readers``) hands it each
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

from ..errors import CorruptBlobError
from ..format import reader_worker
from ..format.pinned import Lane, Placed
from ..format.readers import Piece
from ..records import TensorSpec

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
    """One slot of a run: lane slot ``slot`` holds file bytes [pos, pos + n), of
    which ``pieces`` are tensors' (slot bytes [a, b)); once checked it lands at
    offset ``off`` of staging chunk ``chunk`` and its ``placed`` pieces are noted."""

    slot: int
    n: int
    pos: int
    chunk: int
    off: int
    pieces: list[tuple[Want, int, int]]
    placed: list[Placed]


Land = Callable[[Slot], None]  # the slot's copy queued, its pieces noted


def read_here(lane: Lane, fd: int, slots: Iterator[Slot], land: Land, where: str) -> None:
    """Fill each slot on this thread, then land it."""
    hashers: dict[str, Any] = {}  # tensors that span slots
    for s in slots:
        view = memoryview(lane.slots[s.slot]).cast("B")[: s.n]  # type: ignore[arg-type]
        _fill(view, fd, s.pos, s.n, s.pieces, hashers, where)
        land(s)


def read_in_worker(lane: Lane, fd: int, slots: Iterator[Slot], land: Land) -> None:
    """Each slot asked of the lane's reader process one slot ahead: the next
    request goes out before the last answer is awaited."""
    send, answer = lane.send, lane.answer  # type: ignore[attr-defined]
    pending: tuple[Any, Slot] | None = None
    try:
        for i, s in enumerate(slots):  # the next slot: its previous copy is done
            pieces = [_piece(w, a, b, s.pos) for w, a, b in s.pieces]
            # pending first: if the last answer fails, this request is still drained
            last, pending = pending, (send(s.slot, fd, s.pos, s.n, pieces, i == 0), s)
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
    return Piece(a, b, w.start, a + pos == w.start, b + pos == w.end, w.want, w.where)


def _fill(
    view: memoryview,
    fd: int,
    pos: int,
    n: int,
    pieces: list[tuple[Want, int, int]],
    hashers: dict[str, Any],
    where: str,
) -> None:
    """The slot's bytes [0, n) from file offset ``pos``, checked as a reader process
    checks them (``reader_worker.fill``, PIECE bytes a read)."""
    checks = [
        (a, b, w.key, int(a + pos == w.start) | 2 * int(b + pos == w.end), w.want)
        for w, a, b in pieces
    ]
    got = reader_worker.fill(view, fd, 0, 0, n, pos, checks, hashers, PIECE)
    if got == reader_worker.SHORT:
        raise CorruptBlobError(where, "file truncated inside a tensor")
    if got is not None:
        bad = next(w for w, _, _ in pieces if w.key == got)
        raise CorruptBlobError(bad.where, "checksum mismatch in tensor data")
