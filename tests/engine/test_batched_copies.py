"""A direct restore's slot placed by one batched driver call puts every byte where a
strided copy per piece does (issue 39), and the batched call's binding adapts the
CUDA 12.8 signature to 13.0's.  Without a GPU: the driver's copies done as host
memmoves, so what is tested is the lane's rows, not the copy engine (the H200 and
H100 runs check the engine: bench/cuda_copy_probe)."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from persist.cuda import driver as driver_mod
from persist.cuda.cuda_lane import CudaLane
from persist.cuda.pinned import Placed
from persist.engine.staged import restore as staging


class HostDriver:
    """The driver's copies as memmoves in host memory; ``batched`` says which way."""

    def __init__(self, batched: bool) -> None:
        self.batched = batched
        self.calls = 0

    def stream(self) -> int:
        return 1

    def event(self) -> int:
        return 1

    def record(self, event: int, stream: int) -> None:
        pass  # host copies are done on return: nothing to wait for

    def copy_rows_in(self, src: int, dst: int, w: int, h: int, sp: int, dp: int, s: int) -> None:
        self.calls += 1
        for r in range(h):
            ctypes.memmove(dst + r * dp, src + r * sp, w)

    def copy_batch_in(self, srcs: list[int], dsts: list[int], sizes: list[int], s: int) -> None:
        self.calls += 1
        for a, b, n in zip(srcs, dsts, sizes, strict=True):
            ctypes.memmove(b, a, n)


@st.composite
def slots(draw: st.DrawFn) -> tuple[Any, ...]:
    """Pieces of tensors [heads, tokens, dim] into capacity-sized buffers, some kept
    only in part (a partial hit's limit), several to a slot."""
    n = draw(st.integers(1, 5))
    out = []
    for _ in range(n):
        heads, t, d = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
        at = draw(st.integers(0, 3))
        cap = at + t + draw(st.integers(0, 3))
        limit = draw(st.one_of(st.none(), st.integers(0, cap + 1)))
        out.append(((heads, t, d), at, cap, limit))
    return tuple(out)


def _place(case: tuple[Any, ...], batched: bool) -> tuple[list[bytes], int]:
    src_parts, outs, placed = [], [], []
    rng = np.random.default_rng(1)
    off = 0
    for stored, at, cap, limit in case:
        data = rng.integers(1, 255, int(np.prod(stored)) * 2, dtype=np.uint8)
        out = np.zeros(stored[0] * cap * stored[2] * 2, dtype=np.uint8)
        alloc = (stored[0], cap, stored[2])
        g = staging.geometry(stored, at, staging.Dest(out.ctypes.data, alloc, 1, limit, 2))
        placed.append(Placed(off, 0, data.nbytes, *g))
        src_parts.append(data)
        outs.append(out)
        off += data.nbytes
    slot = np.concatenate(src_parts)
    d = HostDriver(batched)
    lane = CudaLane(d, [slot, slot.copy()])  # type: ignore[arg-type]
    lane.place(0, [c for p in placed for c in staging.placement(p)])
    return [o.tobytes() for o in outs], d.calls


@given(slots())
@settings(max_examples=200, deadline=None)
def test_a_batched_slot_puts_every_byte_where_strided_copies_do(case: tuple[Any, ...]) -> None:
    strided, _ = _place(case, batched=False)
    batched, calls = _place(case, batched=True)
    assert batched == strided
    assert calls <= 1  # one driver call for the whole slot (none where nothing is kept)


class _Counting(HostDriver):
    """Copies that take a while, counting how many run at once."""

    def __init__(self) -> None:
        super().__init__(batched=False)
        self.now = self.most = 0
        self.lock = threading.Lock()

    def copy_rows_in(self, src: int, dst: int, w: int, h: int, sp: int, dp: int, s: int) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.02)  # long enough for the other lane to call in, were it let
        with self.lock:
            self.now -= 1


def test_lanes_sharing_an_issuing_lock_call_the_driver_one_at_a_time() -> None:
    d, issuing = _Counting(), threading.Lock()
    slot = np.zeros(64, dtype=np.uint8)
    lanes = [CudaLane(d, [slot, slot.copy()], issuing=issuing) for _ in range(3)]  # type: ignore[arg-type]
    start = threading.Barrier(3)

    def place(lane: CudaLane) -> None:
        start.wait()
        lane.place(0, [(0, slot.ctypes.data, 8, 1, 8, 8)] * 3)

    threads = [threading.Thread(target=place, args=(lane,)) for lane in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert d.most == 1


class _Lib:
    """A driver library with only the symbols named."""

    def __init__(self, **fns: Any) -> None:
        self.__dict__.update(fns)


def test_the_batched_call_takes_cuda_13s_signature_on_either_driver() -> None:
    seen: list[tuple[Any, ...]] = []

    def v2(*a: Any) -> int:
        seen.append(a)
        return 0

    assert driver_mod._bind_batch(_Lib(cuMemcpyBatchAsync_v2=v2), 13000) is v2
    v1 = driver_mod._bind_batch(_Lib(cuMemcpyBatchAsync=v2), 12080)
    assert v1 is not None
    v1("d", "s", "n", 3, "attrs", "idx", 1, "stream")
    got = seen[-1]
    assert len(got) == 9 and got[:7] == ("d", "s", "n", 3, "attrs", "idx", 1)
    assert got[8] == "stream"  # 12.x's failIdx comes before the stream
    assert driver_mod._bind_batch(_Lib(cuMemcpyBatchAsync=v2), 12060) is None  # before 12.8
    assert driver_mod._bind_batch(_Lib(), 13000) is None


def test_batched_copies_attributes_are_cuda_s_layout() -> None:
    """CUmemcpyAttributes: an enum, two CUmemLocation (type, id) and flags: 24 bytes."""
    assert ctypes.sizeof(driver_mod._CopyAttrs) == 24
    assert driver_mod._CopyAttrs.flags.offset == 20


def test_a_slot_that_keeps_no_byte_makes_no_batched_call() -> None:
    """A slot of pieces past a partial hit's end has no row to copy: the driver is not
    asked for a batch of none (and one with rows gets its count and stream)."""
    seen: list[tuple[Any, ...]] = []

    def call(*a: Any) -> int:
        seen.append(a)
        return 0

    d = driver_mod.Driver.__new__(driver_mod.Driver)  # no libcuda here: the binding faked
    d.batched, d._batch = True, call
    d._attrs, d._attr_at = driver_mod._CopyAttrs(), (ctypes.c_size_t * 1)(0)
    d.copy_batch_in([], [], [], 7)
    assert seen == []
    d.copy_batch_in([1, 2], [3, 4], [5, 6], 7)
    (got,) = seen
    assert list(got[0]) == [3, 4] and list(got[1]) == [1, 2] and list(got[2]) == [5, 6]
    assert got[3].value == 2 and got[7].value == 7
