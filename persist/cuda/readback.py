"""A save's read of device arrays into host memory, on MLX's CUDA backend.

A host read through MLX (``memoryview``, ``np.array``) moves the array's
buffer into CUDA managed memory for good; freed, MLX's buffer cache then hands
that managed buffer to later kernel outputs (a restore's buffers, a cache's
next growth), whose first kernels fault its pages across.  So a save's device
copies are read by the copy engine instead: slot by slot into the staging
lanes' page-locked slots (``cuda/pinned``), each lane on its own thread,
one slot's bytes copied into the new host array while the next slot fills.
A save is background work and a restore is a request waiting: the capture
takes the lanes one run of arrays at a time (``PIECE_BYTES``) and only while
no restore waits for them.  Where the lanes are busy or absent, one
synchronous driver copy per array, into pageable memory, does the same more
slowly.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future

import mlx.core as mx
import numpy as np

from ..yielding import pause
from . import pinned
from .addressing import address, rows
from .driver import Driver
from .kernels import addresses

__all__ = ["copies_first", "host_copies", "layouts", "pieces"]

PIECE_BYTES = 64 << 20  # a capture's run on the lanes: about 3 ms of copy at 25 GB/s

Chunk = tuple[int, np.ndarray, int, int]  # device address, host array, offset, bytes
Layout = tuple[int, int, int, int]  # first row, bytes a row, rows, pitch (addressing.rows)


def host_copies(arrays: list[mx.array]) -> list[np.ndarray] | None:
    """Each evaluated device array's bytes, in row order, in new host memory (uint8,
    flat); None where this process has no driver (``pinned.data_path``)."""
    choice = pinned.data_path()
    if choice.driver is None:
        return None
    outs = [np.empty(a.nbytes, dtype=np.uint8) for a in arrays]
    keep: list[mx.array] = []  # copies made for layouts the driver cannot read as rows
    found = layouts(arrays, keep, choice.driver)
    ring = choice.ring
    for piece in pieces([out.nbytes for out in outs], PIECE_BYTES):
        pause()  # persist serve's write-behind waits here while a request prompts
        a, o = [found[i] for i in piece], [outs[i] for i in piece]
        if ring is not None and ring.free_for_capture():
            try:
                _through_lanes(ring, a, o)
            finally:
                ring.lock.release()
        else:
            _direct(choice.driver, a, o)
    return outs


def copies_first() -> bool:
    """Must a save copy its arrays on the device before they are read back?  Not on
    the direct path with a driver whose row reads were proven: it reads a KV
    cache's strided slice row by row where it lies (no kernel, no second copy of
    the cache on the device, issue 39)."""
    driver = pinned.data_path().driver if pinned.direct() else None
    return driver is None or not rows_proven(driver)


def layouts(arrays: list[mx.array], keep: list[mx.array], driver: Driver) -> list[Layout]:
    """Each array as rows of bytes (``addressing.rows``): read where they lie when the ring is
    direct (no kernel to build: a fresh process's first save paid 1.4 s for the
    kernel's, issue 39), a layout that is not rows (or rows not proven on this
    driver) read from a contiguous copy (kept alive in ``keep``); else the
    address kernel's (its input is a copy)."""
    if not pinned.direct():
        found = addresses(arrays)
        return [(addr, a.nbytes, 1, a.nbytes) for addr, a in zip(found, arrays, strict=True)]
    by_rows = rows_proven(driver)
    out: list[Layout] = []
    for a in arrays:
        if not a.nbytes:
            out.append((0, 0, 0, 0))
            continue
        if by_rows:
            try:
                out.append(rows(a))
                continue
            except ValueError:
                pass
        c = mx.contiguous(a)
        mx.eval(c)
        keep.append(c)
        out.append((address(c), c.nbytes, 1, c.nbytes))
    return out


# per driver object, not id(): a freed driver's id may be a new one's
_proven: weakref.WeakKeyDictionary[Driver, bool] = weakref.WeakKeyDictionary()


def rows_proven(driver: Driver) -> bool:
    """Do row reads through this driver give what a contiguous copy gives?  Checked
    once per driver on a small strided slice before any save relies on it: layouts
    another MLX build reports differently must cost a device copy, never a wrong
    cache."""
    if driver not in _proven:
        _proven[driver] = _rows_match(driver)
    return _proven[driver]


def _rows_match(driver: Driver) -> bool:
    whole = mx.arange(1 * 3 * 40 * 8, dtype=mx.uint32).reshape(1, 3, 40, 8)
    part = whole[..., 5:34, :]  # rows a buffer's row apart, not at its start
    flat = mx.contiguous(part)
    mx.eval(part, flat)
    try:
        start, width, height, pitch = rows(part)
        at = address(flat)
    except ValueError:
        return False
    if width * height != part.nbytes:
        return False
    got, want = np.empty(part.nbytes, np.uint8), np.empty(part.nbytes, np.uint8)
    driver.make_current()
    for r in range(height):
        driver.copy_out(start + r * pitch, got.ctypes.data + r * width, width)
    driver.copy_out(at, want.ctypes.data, want.nbytes)
    expect = np.arange(whole.size, dtype=np.uint32).reshape(1, 3, 40, 8)[..., 5:34, :]
    return bool(
        np.array_equal(got, want) and np.array_equal(got.view(np.uint32).ravel(), expect.ravel())
    )


def pieces(sizes: list[int], most: int) -> list[list[int]]:
    """The arrays' indexes in order, cut into runs of at most ``most`` bytes each
    (an array larger than that is a run of its own): a save's capture takes the
    lanes a run at a time, so a restore that asks waits for one run at most."""
    runs: list[list[int]] = []
    held = 0  # bytes in the last run
    for i, n in enumerate(sizes):
        if not runs or held + n > most:
            runs.append([])
            held = 0
        runs[-1].append(i)
        held += n
    return runs


def _direct(driver: Driver, found: list[Layout], outs: list[np.ndarray]) -> None:
    driver.make_current()
    for (start, width, height, pitch), out in zip(found, outs, strict=True):
        for r in range(height if width else 0):
            driver.copy_out(start + r * pitch, out.ctypes.data + r * width, width)


def _chunks(found: list[Layout], outs: list[np.ndarray], slot: int) -> list[Chunk]:
    """Every row of every array, cut at slot boundaries: (address, out, offset, bytes)."""
    return [
        (start + r * pitch + o, out, r * width + o, min(slot, width - o))
        for (start, width, height, pitch), out in zip(found, outs, strict=True)
        for r in range(height if width else 0)
        for o in range(0, width, slot)
    ]


def _through_lanes(ring: pinned.Ring, found: list[Layout], outs: list[np.ndarray]) -> None:
    chunks = _chunks(found, outs, ring.slot_bytes)
    lanes = ring.lanes
    pool = ring.pool()
    futures: list[Future[None]] = []
    try:
        for i, lane in enumerate(lanes):
            futures.append(pool.submit(_lane_copies, lane, chunks[i :: len(lanes)]))
        for f in futures:
            f.result()
    finally:  # no lane still writes a slot or an array after this returns, Ctrl-C or not
        pinned.settle(futures, ring)


def _lane_copies(lane: pinned.Lane, chunks: list[Chunk]) -> None:
    """One lane's chunks: slot s fills while the previous slot's bytes are copied out."""
    lane.current()  # not enter(): a save never needs, nor restarts, a reader process
    held: tuple[int, np.ndarray, int, int] | None = None
    for src, out, o, n in chunks:
        s = lane.take()
        lane.fetch(s, src, n)
        if held is not None:
            _land(lane, *held)
        held = (s, out, o, n)
    if held is not None:
        _land(lane, *held)


def _land(lane: pinned.Lane, s: int, out: np.ndarray, o: int, n: int) -> None:
    lane.settle(s)
    out[o : o + n] = lane.slots[s][:n]
