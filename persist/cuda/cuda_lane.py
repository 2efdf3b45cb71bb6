"""The copy engine's lanes (``pinned.Lane`` on CUDA): two page-locked slots each, a
stream of its own and an event per slot.

A direct ring's lanes may share ``issuing`` (``PERSIST_DIRECT_ISSUE=serial``): one
lane issues its placement copies at a time, to measure whether eight threads
calling the driver at once cost more than they overlap (bench/cuda_copy_probe).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import numpy as np

from .driver import Driver
from .readers import Readers

__all__ = ["CudaLane", "Rows", "pinned_slots"]

Rows = tuple[int, int, int, int, int, int]  # src offset, dst, width, height, spitch, dpitch


class CudaLane:
    """A lane on the copy engine: two pinned slots, a stream of its own, an event per
    slot; with ``readers``, its reader process fills the slots (``send``, ``answer``)."""

    def __init__(
        self,
        driver: Driver,
        slots: list[np.ndarray],
        readers: Readers | None = None,
        i: int = 0,
        issuing: contextlib.AbstractContextManager[object] | None = None,
    ) -> None:
        self.driver, self.slots = driver, slots
        self.issuing = contextlib.nullcontext() if issuing is None else issuing
        self.hosts = [int(s.ctypes.data) for s in slots]
        self.stream = driver.stream()
        self.events = [driver.event(), driver.event()]
        self.pending = [False, False]
        self.turn = 0
        self.readers, self.i = readers, i
        if readers is not None:
            self.send = functools.partial(readers.send, i)
            self.answer = readers.answer

    def enter(self) -> None:
        self.driver.make_current()
        if self.readers is not None:
            self.readers.ready(self.i)

    def take(self) -> int:
        i, self.turn = self.turn, self.turn ^ 1
        self.settle(i)
        return i

    def put(self, slot: int, dst: int, n: int) -> None:
        self.driver.copy_in(self.hosts[slot], dst, n, self.stream)
        self._busy(slot)

    def place(self, slot: int, copies: list[Rows]) -> None:
        host, d = self.hosts[slot], self.driver
        with self.issuing:
            self._place(host, d, copies)
        self._busy(slot)

    def _place(self, host: int, d: Driver, copies: list[Rows]) -> None:
        if d.batched:  # every row of the slot's pieces in one driver call
            rows = [(host + s + r * sp, t + r * dp, w)
                    for s, t, w, h, sp, dp in copies for r in range(h)]  # fmt: skip
            srcs, dsts, sizes = zip(*rows, strict=True) if rows else ((), (), ())
            d.copy_batch_in(srcs, dsts, sizes, self.stream)
        else:
            for src, dst, width, height, spitch, dpitch in copies:
                d.copy_rows_in(host + src, dst, width, height, spitch, dpitch, self.stream)

    def drain(self) -> None:
        self.driver.make_current()
        self.driver.wait_stream(self.stream)
        self.pending = [False, False]

    def current(self) -> None:
        self.driver.make_current()

    def fetch(self, slot: int, src: int, n: int) -> None:
        self.driver.copy_out_async(src, self.hosts[slot], n, self.stream)
        self._busy(slot)

    def settle(self, slot: int) -> None:
        if self.pending[slot]:
            self.driver.wait_event(self.events[slot])
            self.pending[slot] = False

    def _busy(self, slot: int) -> None:
        """The slot is in use until the copy just queued on the stream is done."""
        self.driver.record(self.events[slot], self.stream)
        self.pending[slot] = True


def pinned_slots(driver: Driver, size: int) -> list[np.ndarray]:
    return [
        np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(driver.host_alloc(size)[0]))
        for _ in range(2)
    ]
