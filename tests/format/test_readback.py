"""A save's read-back of device arrays (cuda/readback), on the CPU: host lanes
whose ``fetch`` is a memmove stand in for the copy engine and its page-locked
slots, so the chunking, the two slots per lane and the fallback run here;
on CUDA the same runs against the driver (tests/engine/test_host_tier_cuda.py)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist.cuda import pinned, readback
from persist.cuda.pinned import CUDA_PINNED, Choice, Ring
from tests.helpers import ON_CUDA
from tests.host_lanes import HostLane, host_buffers, host_scatter

# stand-in drivers memmove host memory; on CUDA the addresses are device memory
# (the real driver's tests: tests/engine/test_host_tier_cuda.py, test_no_kernel_path.py)
pytestmark = pytest.mark.skipif(
    ON_CUDA, reason="memmove stand-ins for the driver: host memory only"
)

SLOT = 1024


class CopyDriver:
    """The driver's synchronous device -> host copy, as a memmove (and counted)."""

    def __init__(self) -> None:
        self.direct = 0

    def make_current(self) -> None:
        pass

    def copy_out(self, src: int, dst: int, n: int) -> None:
        ctypes.memmove(dst, src, n)
        self.direct += 1


def address(a: mx.array) -> int:
    if not a.nbytes:
        return 0
    return int(np.asarray(memoryview(a.reshape(-1).view(mx.uint8))).ctypes.data)


@pytest.fixture
def lanes(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(readback, "addresses", lambda arrays: [address(a) for a in arrays])
    ring = Ring([HostLane(SLOT) for _ in range(3)], host_buffers, host_scatter)
    driver = CopyDriver()
    with pinned.use(Choice(CUDA_PINNED, "test lanes", ring, driver)):  # type: ignore[arg-type]
        assert readback.rows_proven(driver)  # type: ignore[arg-type]
        driver.direct = 0  # the proof's own copies: not the test's
        yield ring, driver


def arrays_of(sizes: list[int], seed: int) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    out = [mx.array(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    out.append(mx.array(rng.standard_normal((7, 33)).astype(np.float32)).astype(mx.bfloat16))
    mx.eval(out)
    return out


def raw(a: mx.array) -> bytes:
    b = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.asarray(memoryview(b)).tobytes() if a.nbytes else b""


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(st.integers(0, 5 * SLOT + 7), max_size=9), seed=st.integers(0, 9))
def test_every_byte_comes_back_through_the_lanes(lanes: Any, sizes: list[int], seed: int) -> None:
    ring, driver = lanes
    arrays = arrays_of(sizes, seed)
    before = [lane.fetched for lane in ring.lanes]
    got = readback.host_copies(arrays)
    assert got is not None and driver.direct == 0
    assert [g.tobytes() for g in got] == [raw(a) for a in arrays]
    chunks = sum(-(-a.nbytes // SLOT) for a in arrays)
    assert sum(lane.fetched for lane in ring.lanes) - sum(before) == chunks


@pytest.mark.parametrize("busy", [False, True])
def test_a_kv_slice_is_read_row_by_row_where_it_lies(lanes: Any, busy: bool) -> None:
    """The direct path reads a strided slice without a device copy (issue 39): one
    row of bytes per head, a buffer's row apart, rows cut at slot boundaries."""
    ring, driver = lanes
    rng = np.random.default_rng(4)
    whole = mx.array(rng.standard_normal((1, 3, 300, 8)).astype(np.float32)).astype(mx.bfloat16)
    arrays = [whole[..., :170, :], whole[..., :1, :], mx.array(np.arange(50, dtype=np.uint8))]
    arrays.append(mx.array(np.arange(24, dtype=np.float32)).reshape(4, 6).T)  # not rows: a copy
    mx.eval(arrays)
    assert pinned.direct() and not readback.copies_first()
    if busy:
        with ring.lock:
            got = readback.host_copies(arrays)
        assert driver.direct == 3 + 3 + 1 + 1  # a call a row (a head each, then two arrays)
    else:
        got = readback.host_copies(arrays)
    assert got is not None and [g.tobytes() for g in got] == [raw(a) for a in arrays]


def test_with_the_lanes_busy_one_direct_copy_per_array(lanes: Any) -> None:
    """A restore holds the lanes (or this thread is inside one): no wait for them."""
    ring, driver = lanes
    arrays = arrays_of([0, 1, SLOT + 1, 3 * SLOT], 1)
    with ring.lock:
        got = readback.host_copies(arrays)
    assert got is not None and [g.tobytes() for g in got] == [raw(a) for a in arrays]
    assert driver.direct == sum(1 for a in arrays if a.nbytes)
    assert sum(lane.fetched for lane in ring.lanes) == 0


class WrongRows(CopyDriver):
    """A driver whose row reads land elsewhere (a DLPack layout misread)."""

    def copy_out(self, src: int, dst: int, n: int) -> None:
        super().copy_out(src + 4 if n < 1000 else src, dst, n)  # a row, not a whole


def test_rows_that_do_not_read_back_right_are_never_used() -> None:
    wrong = WrongRows()
    assert not readback.rows_proven(wrong)  # type: ignore[arg-type]
    ring = Ring([HostLane(SLOT)], host_buffers, host_scatter)
    with pinned.use(Choice(CUDA_PINNED, "test lanes", ring, wrong)):  # type: ignore[arg-type]
        assert readback.copies_first()  # a save copies on the device first, as before
        whole = mx.array(np.arange(3 * 100 * 4, dtype=np.float32).reshape(1, 3, 100, 4))
        arrays = [whole[..., :80, :]]  # rows of 320 bytes: read as a whole copy instead
        mx.eval(arrays)
        with ring.lock:  # every read through the (wrong-for-rows) driver
            got = readback.host_copies(arrays)
        assert got is not None and got[0].tobytes() == raw(arrays[0])


def test_without_a_driver_there_is_nothing_to_do() -> None:
    with pinned.use(Choice(pinned.HOST, "the CPU")):
        assert readback.host_copies(arrays_of([5], 0)) is None


@pytest.mark.usefixtures("python_ctrl_c")
def test_ctrl_cs_during_a_read_back_wait_for_the_lanes(lanes: Any) -> None:
    """Attack (round 4, session 2): two Ctrl-Cs during a save's read-back released the
    ring while lanes still fetched into their slots and the new arrays."""
    ring, _ = lanes
    fetched: list[float] = []
    for lane in ring.lanes:
        fetch = lane.fetch

        def slow(slot: int, src: int, n: int, fetch: Any = fetch) -> None:
            time.sleep(0.05)
            fetch(slot, src, n)
            fetched.append(time.monotonic())

        lane.fetch = slow
    arrays = arrays_of([40 * SLOT], 3)
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (0.2, 0.4)]
    for t in timers:
        t.start()
    with pytest.raises(KeyboardInterrupt):
        readback.host_copies(arrays)
    returned = time.monotonic()
    for t in timers:
        t.join()
    # a no-op per lane thread runs only once every lane job is over
    for f in [ring.pool().submit(time.sleep, 0) for _ in ring.lanes]:
        f.result()
    assert fetched and max(fetched) <= returned  # no lane fetched after the return
    assert ring.lock.acquire(blocking=False)
    ring.lock.release()
