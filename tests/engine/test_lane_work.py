"""The work a staged restore's lanes share (engine/staged/lane_work): blobs cut into
tasks at tensor boundaries, handed to whichever lane asks, each blob closed
with its last task."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import persist
from persist.engine.staged.lane_work import GAP, Job, Work, tasks
from persist.engine.staged.slot_reads import Want
from persist.records import TensorSpec
from tests.helpers import assert_same_state, live_state, prefill, tokens_for
from tests.host_lanes import HostLane, host_ring, staged


def wants_of(sizes_and_gaps: list[tuple[int, int]]) -> list[Want]:
    out, pos = [], 0
    for i, (size, gap) in enumerate(sizes_and_gaps):
        pos += gap
        stored = TensorSpec("uint8", (size,))
        out.append(
            Want(key=f"t{i}", start=pos, end=pos + size, stored=stored, at=0, want=b"", where="w")
        )
        pos += size
    return out


layouts = st.lists(
    st.tuples(st.integers(0, 5000), st.sampled_from([0, 0, 1, GAP, GAP + 1, 10**6])),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(layouts, st.integers(1, 9000), st.randoms())
def test_tasks_cut_runs_at_tensor_boundaries(
    layout: list[tuple[int, int]], size: int, rnd: Any
) -> None:
    """Every non-empty tensor in exactly one task, in file order; a task's tensors
    at most GAP apart and at most ``size`` bytes in all unless one tensor alone is
    larger; and each cut was needed (the next tensor was too far or too big)."""
    wants = wants_of(layout)
    shuffled = list(wants)
    rnd.shuffle(shuffled)
    got = tasks(shuffled, size)
    assert [w for t in got for w in t] == [w for w in wants if w.end > w.start]
    for t in got:
        assert t and (len(t) == 1 or t[-1].end - t[0].start <= size)
        assert all(b.start - a.end <= GAP for a, b in itertools.pairwise(t))
    for a, b in itertools.pairwise(got):
        assert b[0].start - a[-1].end > GAP or b[0].end - a[0].start > size


class Opened:
    """Jobs that open nothing: each blob's descriptor is its number, closes counted."""

    def __init__(self, blobs: list[list[tuple[int, int]]]) -> None:
        self.closed: list[int] = []
        self.lock = threading.Lock()
        self.jobs = [Job(lambda i=i, b=b: self.open(i, b)) for i, b in enumerate(blobs)]

    def open(self, i: int, layout: list[tuple[int, int]]) -> Any:
        def close() -> None:
            with self.lock:
                self.closed.append(i)

        return i, wants_of(layout), close


def test_lanes_share_every_task_once_and_each_blob_closes_with_its_last() -> None:
    blobs = [[(100, 0)] * n for n in (7, 0, 1, 30, 3, 12)]  # one blob wants nothing
    opened = Opened(blobs)
    work = Work(opened.jobs, lambda w: (0, 0, 0, 0), 250, 4)
    taken: list[tuple[int, str]] = []
    lock = threading.Lock()

    def lane() -> None:
        while (task := work.take()) is not None:
            with lock:
                taken.extend((task.blob.fd, w.key) for w in task.wants)
            assert task.blob.fd not in opened.closed  # open while its task is out
            work.landed(task.blob)

    threads = [threading.Thread(target=lane) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == sorted((i, f"t{k}") for i, b in enumerate(blobs) for k in range(len(b)))
    assert sorted(opened.closed) == list(range(len(blobs)))  # each once
    events = [work.events.get_nowait() for _ in range(work.events.qsize())]
    assert events == [1] * len(blobs) and work.open == []


def test_blobs_left_open_by_an_error_are_closed_once() -> None:
    opened = Opened([[(100, 0)] * 6, [(100, 0)] * 6])
    work = Work(opened.jobs, lambda w: (0, 0, 0, 0), 250, 1)
    first = work.take()
    assert first is not None
    work.landed(first.blob)  # one task of three landed, then the lanes stopped
    work.close_all()
    work.close_all()
    assert opened.closed == [0]  # opened ahead: only what was opened is closed


def test_a_blob_is_read_by_every_lane(tiny: Any, tmp_path: Path) -> None:
    """A lane used to own a whole blob: one large blob was read by one lane while
    the others waited.  Now its tasks go to every lane that asks."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    prompt = tokens_for(100, seed=8)
    cache = prefill(model, prompt)[0]
    ring = host_ring(3, 1024)
    # each lane's first copy waits until every lane has one: a lane owning the blob
    # would leave the others nothing, and the barrier breaks (no clock decides)
    everyone = threading.Barrier(3, timeout=60)
    for lane in ring.lanes:
        put, first = lane.put, [True]

        def waiting(*a: Any, put: Any = put, first: list[bool] = first) -> None:
            if first.pop() if first else False:
                everyone.wait()
            put(*a)

        lane.put = waiting  # type: ignore[method-assign]
    with persist.Store(tmp_path / "s", block_tokens=4096) as store:  # the tail blob only
        info = store.save(cache, prompt, identity=ident, session="s")
        assert len(store.index.blocks(info.id)) == 0
        with staged(ring):
            got = store.restore("s", identity=ident).cache
    assert_same_state(live_state(got), live_state(cache))
    lanes: list[HostLane] = ring.lanes  # type: ignore[assignment]
    assert all(lane.copies > 0 for lane in lanes), [lane.copies for lane in lanes]
