"""A save's read-back of device arrays (format/readback), on the CPU: host lanes
whose ``fetch`` is a memmove stand in for the copy engine and its page-locked
slots, so the chunking, the two slots per lane and the fallback run here;
on CUDA the same runs against the driver (tests/engine/test_host_tier_cuda.py)."""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from persist.format import pinned, readback
from persist.format.pinned import CUDA_PINNED, Choice, Ring
from tests.engine.test_staging import HostLane, host_buffers, host_scatter

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


def test_with_the_lanes_busy_one_direct_copy_per_array(lanes: Any) -> None:
    """A restore holds the lanes (or this thread is inside one): no wait for them."""
    ring, driver = lanes
    arrays = arrays_of([0, 1, SLOT + 1, 3 * SLOT], 1)
    with ring.lock:
        got = readback.host_copies(arrays)
    assert got is not None and [g.tobytes() for g in got] == [raw(a) for a in arrays]
    assert driver.direct == sum(1 for a in arrays if a.nbytes)
    assert sum(lane.fetched for lane in ring.lanes) == 0


def test_without_a_driver_there_is_nothing_to_do() -> None:
    with pinned.use(Choice(pinned.HOST, "the CPU")):
        assert readback.host_copies(arrays_of([5], 0)) is None
