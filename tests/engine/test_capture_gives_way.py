"""A save's capture gives the staging lanes way to a restore (cuda/pinned, cuda/readback).

In ``persist serve`` the write-behind captures the cache of the request it just
answered while the next request may be restoring one: the restore is what a
client waits for.  The lanes' rule: a restore waiting for them keeps a capture
off, and a capture takes them one run of arrays at a time, so a restore waits
for at most one run.  The lanes here are host lanes (tests/host_lanes.py); the
rule is the Ring's, the same on CUDA.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from persist.cuda.readback import pieces
from tests.host_lanes import host_ring

WAIT = 30.0  # a bound on waiting for the other thread, never a timing assertion


def _until(cond: object, what: str) -> None:
    end = time.monotonic() + WAIT
    while not cond():  # type: ignore[operator]
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.001)


def test_a_capture_takes_free_lanes_and_gives_them_back() -> None:
    ring = host_ring(2, 64)
    assert ring.free_for_capture()
    assert not ring.free_for_capture()  # held by the first piece
    ring.lock.release()
    assert ring.free_for_capture()
    ring.lock.release()


def test_a_waiting_restore_keeps_the_next_piece_of_a_capture_off_the_lanes() -> None:
    ring = host_ring(2, 64)
    assert ring.free_for_capture()  # a capture's piece holds the lanes
    got, done = threading.Event(), threading.Event()

    def restore() -> None:
        with ring.for_restore():
            got.set()
            done.wait(WAIT)  # the restore holds the lanes until the test has looked

    t = threading.Thread(target=restore)
    t.start()
    _until(lambda: ring._waiting == 1, "the restore to wait")
    ring.lock.release()  # the piece is done
    # the restore is waiting or has the lanes: either way the next piece copies another way
    assert not ring.free_for_capture()
    assert got.wait(WAIT)
    done.set()
    t.join(WAIT)
    assert ring.free_for_capture()  # after the restore, captures use the lanes again
    ring.lock.release()


def test_a_restore_waits_for_a_running_piece_and_then_runs() -> None:
    ring = host_ring(2, 64)
    order: list[str] = []
    assert ring.free_for_capture()

    def restore() -> None:
        with ring.for_restore():
            order.append("restore")

    t = threading.Thread(target=restore)
    t.start()
    _until(lambda: ring._waiting == 1, "the restore to wait")
    order.append("piece done")
    ring.lock.release()
    t.join(WAIT)
    assert order == ["piece done", "restore"]
    assert ring._waiting == 0


@given(st.lists(st.integers(0, 300), max_size=40), st.integers(1, 256))
def test_pieces_keep_order_and_stay_under_the_bound(sizes: list[int], most: int) -> None:
    runs = pieces(sizes, most)
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    for run in runs:
        assert run  # no empty run
        if len(run) > 1:  # only an array larger than the bound has a run above it
            assert sum(sizes[i] for i in run) <= most
