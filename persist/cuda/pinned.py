"""Pinned host staging for MLX's CUDA backend, and which data path a process takes.

MLX puts an array made from host memory in CUDA managed memory and never
prefetches it: the first kernels that read a restored cache pull it across
page by page (0.64 s per GiB on an H200), and a host read of a live cache
moves it there for good.  Kernel outputs live in device memory.  So on CUDA
a restore first makes every tensor's buffer and a staging buffer as kernel
outputs (address known: ``cuda/kernels``); reader processes
(``cuda/readers``; threads where they cannot start) read file bytes into
page-locked slots (a shared mapping page-locked by the driver, or
``cuMemHostAlloc``, through ctypes on the driver library that is always
present where MLX's CUDA backend runs), and the copy engine moves each slot
whole into the staging buffer, on a stream per lane (``Lane``): one driver
call per slot, at the bus's speed, and no MLX call while the readers run.
One kernel then moves every tensor's bytes to their places (``scatter``), at
the device's speed.

The choice is made once per process (``data_path``): CUDA with the driver and
the lanes -> ``cuda-pinned``; anything else (CPU, Metal, no driver, a failed
pinned allocation, ``PERSIST_DATA_PATH=host``) -> ``host``, today's path of
reading into MLX buffers, with the reason kept for ``persist stats``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from . import addressing
from .cuda_lane import CudaLane, Rows, pinned_slots
from .driver import Driver
from .kernels import Placed, device_buffers, scatter
from .readers import Readers

__all__ = [
    "Ring",
    "Choice",
    "data_path",
    "use",
    "backend",
    "CUDA_PINNED",
    "HOST",
    "SLOT_BYTES",
    "LANES",
    "Placed",
    "Lane",
    "Rows",
]

CUDA_PINNED = "cuda-pinned"
HOST = "host"
SLOT_BYTES = 8 << 20  # one staged read: few driver calls, and the bytes still overlap
LANES = 8  # readers, each with two slots: 128 MiB of page-locked memory, once per process


class Lane(Protocol):
    """One reader's staging: two page-locked slots, and the copy out of each.

    A reader reads into one slot while the other's copy runs: ``take`` gives
    the next slot once its earlier copy is done, ``put`` queues the copy of a
    slot's first ``n`` bytes to a device address and returns at once,
    ``place`` queues a slot's pieces each to its tensor's rows (``Rows``: offset
    in the slot, device address, width, height, source and destination pitch),
    ``drain`` waits for every copy of the lane.  The other way (a save's read
    back, ``cuda/readback``): ``current`` readies the thread for the lane's
    copies (``enter`` without the reader), ``fetch`` queues a copy of ``n``
    device bytes into a slot, ``settle`` waits for it.  A lane may also have
    ``send(slot, fd, pos=..., n=..., pieces=..., fresh=...)`` and ``answer(sent)``: its reader
    process reads and checks the slot (``cuda/readers``); without them the
    reader thread does (``engine/staged/slot_reads``).
    """

    slots: list[np.ndarray]

    def enter(self) -> None: ...

    def take(self) -> int: ...

    def put(self, slot: int, dst: int, n: int) -> None: ...

    def place(self, slot: int, copies: list[Rows]) -> None: ...

    def drain(self) -> None: ...

    def fetch(self, slot: int, src: int, n: int) -> None: ...

    def settle(self, slot: int) -> None: ...

    def current(self) -> None: ...


# sizes in bytes -> [(uint8 device array, its address)], zeroed, evaluated
Buffers = Callable[[list[int]], list[tuple[mx.array, int]]]
# a staging buffer, the pieces in it to put in place (done on return)
Scatter = Callable[[mx.array, list[Placed]], None]


class Ring:
    """The lanes of a process, lent to one restore at a time (``lock``), and how
    that restore gets device buffers (``buffers``) and moves staged bytes from
    one into the others (``scatter``)."""

    def __init__(
        self,
        lanes: list[Lane],
        buffers: Buffers,
        scatter: Scatter,
        readers: Readers | None = None,
        direct: bool = False,
    ) -> None:
        self.lanes, self.buffers, self.scatter = lanes, buffers, scatter
        # each slot's pieces copied straight to their tensors (``Lane.place``), no
        # staging buffer on the device and no scatter (engine/staged/restore)
        self.direct = direct
        self.readers = readers  # the lanes' reader processes, if they have them
        self.lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._waiting = 0  # restores waiting for ``lock``: a save's capture gives way
        self._count = threading.Lock()

    @contextlib.contextmanager
    def for_restore(self) -> Iterator[None]:
        """The lanes for one restore.  A restore is a request waiting; a save's
        capture is background work, so it takes the lanes only while no restore
        waits (``free_for_capture``) and a piece at a time: a restore waits for at
        most one piece of a capture, never a whole cache's."""
        with self._count:
            self._waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        try:
            yield
        finally:
            self.lock.release()

    def free_for_capture(self) -> bool:
        """Take ``lock`` for one piece of a capture when no restore waits for it and
        nothing holds it (the caller releases it); False: copy another way."""
        return self._waiting == 0 and self.lock.acquire(blocking=False)

    def pool(self) -> ThreadPoolExecutor:
        """One thread per lane, started once and kept (call with ``lock`` held).

        Started on demand, eight threads reached their first read 1 to 16 ms
        after a restore began on an H200 (each start waits for the GIL among
        readers already running)."""
        if self._pool is None:
            n = len(self.lanes)
            pool = ThreadPoolExecutor(n, "persist-stage")
            met = threading.Barrier(n)  # every thread started, so n distinct threads
            for f in [pool.submit(met.wait, 30.0) for _ in range(n)]:
                f.result()
            self._pool = pool
        return self._pool

    def warm(self) -> None:
        """What a process's first restore would start or touch, done now: the lane
        threads (``pool``) and each reader process's slots (``Readers.touch``).  On an
        H200 a fresh process's first restore after the kernels were built still took
        2.3x a later one (bench/results/cuda-first-call-r10.md)."""
        with self.lock:
            self.pool()
            if self.readers is not None:
                self.readers.touch()

    @property
    def slot_bytes(self) -> int:
        return int(self.lanes[0].slots[0].nbytes)

    def drain(self) -> None:
        """Every copy of every lane done: the buffers hold their bytes, the slots are free."""
        for lane in self.lanes:
            lane.drain()


def settle(futures: list[Future[None]], ring: Ring) -> None:
    """Every lane job of ``futures`` stopped and every copy of the lanes done, even
    through more Ctrl-Cs: until then the lanes and the buffers are in use (the
    ring's next user would share them, and a freed buffer would still be
    written).  The last Ctrl-C is raised after."""
    interrupted: KeyboardInterrupt | None = None
    while True:
        try:
            wait(futures)
            ring.drain()
            break
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted


@dataclass(frozen=True)
class Choice:
    path: str  # CUDA_PINNED or HOST
    reason: str  # why, in words, for persist stats
    ring: Ring | None = None
    driver: Driver | None = None  # CUDA_PINNED's, for device -> host copies

    def describe(self) -> str:
        return f"{self.path} ({self.reason})"


_choice: Choice | None = None
_choice_lock = threading.Lock()


def data_path() -> Choice:
    """This process's data path, decided on the first call."""
    global _choice
    with _choice_lock:
        if _choice is None:
            _choice = _select()
        return _choice


@contextlib.contextmanager
def use(choice: Choice) -> Iterator[Choice]:
    """Tests: take ``choice`` as this process's data path inside the block."""
    global _choice
    with _choice_lock:
        before, _choice = _choice, choice
    try:
        yield choice
    finally:
        with _choice_lock:
            _choice = before


def _select() -> Choice:
    forced = os.environ.get("PERSIST_DATA_PATH", "")
    if forced == HOST:
        return Choice(HOST, "PERSIST_DATA_PATH=host")
    here = backend()
    if here != "cuda":
        return Choice(HOST, f"MLX runs on {here}: arrays are host memory already")
    try:
        driver = Driver()
        ring = _ring(driver)
    except OSError as e:  # no libcuda.so.1, or a driver call that failed
        return Choice(HOST, f"CUDA driver API unavailable ({e})")
    except MemoryError as e:
        return Choice(HOST, f"pinned host memory refused ({e})")
    how = "reader processes" if ring.readers else "reader threads"
    slots = f"{2 * LANES} pinned staging buffers of {SLOT_BYTES >> 20} MiB"
    return Choice(CUDA_PINNED, f"{slots}, {LANES} {how}, {LANES} copy streams", ring, driver)


def _ring(driver: Driver) -> Ring:
    """Lanes with reader processes, unless PERSIST_READERS=threads or they cannot be
    had here (no memfd, no process, shared memory the driver will not page-lock)."""
    if os.environ.get("PERSIST_READERS", "processes") != "threads":
        with contextlib.suppress(OSError, MemoryError):
            return _cuda_ring(driver, LANES, SLOT_BYTES, processes=True)
    return _cuda_ring(driver, LANES, SLOT_BYTES)


def backend() -> str:
    dev = mx.default_device()
    if dev.type == mx.cpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "metal"


# the GPU ran its tests bit for bit and it peaks at 1.00x the cache, staging at 1.99x
# (bench/results/cuda-first-call-r8.md); its addresses come from a PTX kernel, not
# DLPack, which moved every array it touched to managed memory (round 5)
DIRECT_BY_DEFAULT = True


def direct() -> bool:
    """Do restores copy slots straight to their tensors, and saves read their arrays
    where they lie (no staging buffer, no kernel of persist's to compile: addresses
    from ``addressing``)?  Where ``PERSIST_STAGING=direct`` asks (or by default,
    ``DIRECT_BY_DEFAULT``) and addresses can be read here (``addressing.usable``);
    ``whole`` and ``rounds`` stage through a device buffer and the scatter kernel."""
    asked = os.environ.get("PERSIST_STAGING", "")
    wanted = asked == "direct" or (DIRECT_BY_DEFAULT and asked not in ("whole", "rounds"))
    return wanted and addressing.usable()


def _cuda_ring(
    driver: Driver, lanes: int, size: int, processes: bool = False, straight: bool | None = None
) -> Ring:
    """``lanes`` lanes of two ``size``-byte pinned slots; with ``processes``, filled by
    reader processes over shared memory that the driver page-locks (``readers``).
    Direct rings (``straight``, by default ``direct()``) make their buffers with
    ``mx.zeros`` (no kernel to build)."""
    mx.eval(mx.zeros(1))  # MLX's CUDA context exists before the driver allocates in it
    straight = direct() if straight is None else straight
    buffers = addressing.zeroed if straight else device_buffers
    # PERSIST_DIRECT_ISSUE=serial: one lane issues its placement copies at a time
    issuing = threading.Lock() if os.environ.get("PERSIST_DIRECT_ISSUE") == "serial" else None
    if not processes:
        made: list[Lane] = [
            CudaLane(driver, pinned_slots(driver, size), issuing=issuing) for _ in range(lanes)
        ]
        _batched(driver, straight)
        return Ring(made, buffers, scatter, direct=straight)
    readers = Readers(lanes, size)
    try:
        driver.host_register(readers.base, readers.nbytes)
    except BaseException:
        readers.close()
        raise
    fed: list[Lane] = [
        CudaLane(driver, readers.slots[i], readers, i, issuing) for i in range(lanes)
    ]
    _batched(driver, straight)
    return Ring(fed, buffers, scatter, readers, direct=straight)


def _batched(driver: Driver, straight: bool) -> None:
    """With PERSIST_DIRECT_COPIES=batched, a direct ring's slots go in one batched
    call each where the driver's proves right; by default a strided copy per piece."""
    if straight and os.environ.get("PERSIST_DIRECT_COPIES", "") == "batched":
        driver.prove_batch()
