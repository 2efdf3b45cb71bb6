"""Where the direct CUDA restore's copies cost time (issue 39; writes OUT/copy-probe.txt).

    python -m bench.cuda_copy_probe OUT_DIR

Part A, the copy engine alone, on the geometry of an 8k Llama-3-8B cache (32
layers x keys and values, 32 blocks of 256 tokens, 8 heads of 128 bf16: a piece
is 8 rows of 64 KiB into a buffer whose rows are 2 MiB apart): 1 GiB from one
pinned buffer to device memory as one copy, as one strided copy per piece (what
``Lane.place`` queues), as one copy per row, and as one batched call per 8 MiB
slot (``cuMemcpyBatchAsync``, where the driver has it), each on one thread and on
8 threads with a stream each; the batched copies checked against the strided ones.

Part B, a real ``Store.restore`` + first step of such a cache (warm page cache), as
it is, with each slot's pieces sent as one plain copy to a scratch buffer (the
bytes cross, placement costs nothing: wrong data, timing only), and with no copy at
all: what placing the pieces costs inside a restore.  Minimum of interleaved
repetitions.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

import persist
from bench import cuda_limits
from bench.common import warm
from bench.shapes import IDENTITY, first_step, llama
from persist.cuda import addressing, pinned
from persist.cuda.driver import Driver

REPS = 5
WARM_LIMIT = "limit: read + copy + GPU read (warm)"
LAYERS, BLOCKS, HEADS, BLOCK, DIM, ITEM = 32, 32, 8, 256, 128, 2
INNER = DIM * ITEM
ROW, PITCH = BLOCK * INNER, BLOCKS * BLOCK * INNER  # 64 KiB rows, 2 MiB apart
PIECE = HEADS * ROW
TENSORS = LAYERS * 2
SLOT_PIECES = (8 << 20) // PIECE


def _pieces(src: int, dsts: list[int]) -> list[tuple[int, int]]:
    """(source address, destination address) of every piece, blob by blob."""
    return [
        (src + (b * TENSORS + t) * PIECE, dsts[t] + b * ROW)
        for b in range(BLOCKS)
        for t in range(TENSORS)
    ]


def part_a(lines: list[str]) -> None:
    d = Driver()
    mx.eval(mx.zeros(1))
    host, _ = d.host_alloc(TENSORS * BLOCKS * PIECE)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * (TENSORS * BLOCKS * PIECE)).from_address(host))
    view[:] = np.random.default_rng(0).integers(0, 256, view.size, dtype=np.uint8)
    bufs = addressing.zeroed([HEADS * PITCH] * TENSORS)
    dsts = [a for _, a in bufs]
    pieces = _pieces(host, dsts)
    streams = [d.stream() for _ in range(8)]
    batch = d.prove_batch()  # the driver's own batched copies, checked as a ring checks them
    lines.append(f"driver {d.version}: batched copies proven: {batch}")

    big = addressing.zeroed([TENSORS * BLOCKS * PIECE])[0]  # held until the end
    big_at = big[1]

    def one_big(ps: list[tuple[int, int]], s: int) -> None:  # as many bytes, in one copy
        at = ps[0][0] - host
        d.copy_in(ps[0][0], big_at + at, len(ps) * PIECE, s)

    def strided(ps: list[tuple[int, int]], s: int) -> None:
        for a, b in ps:
            d.copy_rows_in(a, b, ROW, HEADS, ROW, PITCH, s)

    def by_row(ps: list[tuple[int, int]], s: int) -> None:
        for a, b in ps:
            for r in range(HEADS):
                d.copy_in(a + r * ROW, b + r * PITCH, ROW, s)

    def batched(ps: list[tuple[int, int]], s: int) -> None:
        for i in range(0, len(ps), SLOT_PIECES):
            part = ps[i : i + SLOT_PIECES]
            srcs = [a + r * ROW for a, _ in part for r in range(HEADS)]
            dsts = [b + r * PITCH for _, b in part for r in range(HEADS)]
            d.copy_batch_in(srcs, dsts, [ROW] * len(srcs), s)

    def run(fn: Callable[[list[tuple[int, int]], int], None], threads: int) -> tuple[float, float]:
        share = -(-len(pieces) // threads)
        parts = [pieces[i * share : (i + 1) * share] for i in range(threads)]
        issued = [0.0] * threads

        def go(i: int) -> None:
            d.make_current()
            t = time.perf_counter()
            fn(parts[i], streams[i])
            issued[i] = time.perf_counter() - t

        t = time.perf_counter()
        ts = [threading.Thread(target=go, args=(i,)) for i in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        for s in streams[:threads]:
            d.wait_stream(s)
        return time.perf_counter() - t, max(issued)

    cases: dict[str, tuple[Callable[..., None], int]] = {}
    for threads in (1, 8):
        cases[f"one copy, {threads} thread(s)"] = (one_big, threads)
        cases[f"strided per piece (2048 calls), {threads} thread(s)"] = (strided, threads)
        cases[f"per row (16384 calls), {threads} thread(s)"] = (by_row, threads)
        if batch:
            cases[f"batched per slot (128 calls), {threads} thread(s)"] = (batched, threads)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(REPS):
        for name, (fn, th) in cases.items():
            try:
                got = run(fn, th)
            except Exception as e:  # a driver that refuses: say so, go on
                lines.append(f"{name}: {e!r}")
                cases = {k: v for k, v in cases.items() if k != name}
                break
            old = best.get(name)
            best[name] = got if old is None or got[0] < old[0] else old
    for name, (total, issue) in best.items():
        lines.append(f"{name}: {total * 1000:.1f} ms (issuing {issue * 1000:.1f} ms)")
    src = view.reshape(BLOCKS, TENSORS, HEADS, ROW)
    checks = [("strided", strided), ("batched", batched)] if batch else []
    for name, fn in checks:  # each into buffers of its own, zeroed, tensors 0 and 1 only
        fresh = addressing.zeroed([HEADS * PITCH] * TENSORS)
        every = _pieces(host, [a for _, a in fresh])
        mine = [p for p in every if any(a <= p[1] < a + HEADS * PITCH for _, a in fresh[:2])]
        fn(mine, streams[0])
        d.wait_stream(streams[0])
        for t in range(2):  # read back last: a host read may move an array to managed memory
            back = np.array(fresh[t][0]).reshape(-1)[: HEADS * PITCH].reshape(HEADS, PITCH)
            want = src[:, t].transpose(1, 0, 2).reshape(HEADS, PITCH)
            ok = np.array_equal(back, want)
            lines.append(f"{name} copies put tensor {t}'s bytes in place: {ok}")


def part_b(lines: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="copyprobe-"))
    store = persist.Store(root / "store")
    store.save(llama(8192), list(range(8192)), identity=IDENTITY, session="s")
    blobs = sorted((root / "store" / "blobs").rglob("*.safetensors"))  # not the reserve
    ring = pinned.data_path().ring
    assert ring is not None and ring.direct, "the direct path is not this machine's default"
    lane_cls = type(ring.lanes[0])
    place = lane_cls.place
    scratch, at = addressing.zeroed([64 << 20])[0]

    def one_copy(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        n = sum(c[2] * c[3] for c in copies)
        self.driver.copy_in(self.hosts[slot], at, min(n, 64 << 20), self.stream)  # type: ignore[attr-defined]
        self._busy(slot)  # type: ignore[attr-defined]

    def no_copy(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        return None

    spent = [0.0]

    def timed(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        t = time.perf_counter()
        place(self, slot, copies)  # type: ignore[arg-type]
        spent[0] += time.perf_counter() - t

    issuing = threading.Lock()

    def one_issuer(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        # the lanes' driver calls one lane at a time: do eight threads issuing at once
        # cost more than they overlap (part A: 8 threads 26.7-41 ms, 1 thread 25.5)?
        with issuing:
            place(self, slot, copies)  # type: ignore[arg-type]

    streams = [lane.stream for lane in ring.lanes]  # type: ignore[attr-defined]

    def one_stream(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        # every lane's copies on lane 0's stream: do eight streams cost the copy
        # engine more than they overlap?
        self.stream = streams[0]  # type: ignore[attr-defined]
        place(self, slot, copies)  # type: ignore[arg-type]

    def one_stream_one_issuer(self: object, slot: int, copies: list[tuple[int, ...]]) -> None:
        with issuing:
            one_stream(self, slot, copies)

    driver = ring.lanes[0].driver  # type: ignore[attr-defined]
    proven = driver.batched
    lines.append(f"batched copies proven on this driver: {proven}")
    # name -> (Lane.place, batched copies on)
    variants = {
        "as it is": (place, True), "strided per piece": (place, False),
        "one plain copy per slot": (one_copy, False), "no copy": (no_copy, False),
        "as it is, place timed": (timed, True), "strided, place timed": (timed, False),
        "strided, one lane issuing at a time": (one_issuer, False),
        "batched, one lane issuing at a time": (one_issuer, True),
        "strided, one stream": (one_stream, False),
        "strided, one stream, one lane issuing at a time": (one_stream_one_issuer, False),
    }  # fmt: skip
    best: dict[str, float] = {}
    placing: dict[str, float] = {}
    every = cuda_limits.rows(lambda: blobs)
    limits = {k: every[k] for k in (WARM_LIMIT, "limit: pinned -> device (copy engine)")}
    for _ in range(REPS):
        for name, (fn, batched) in variants.items():
            lane_cls.place = fn  # type: ignore[method-assign,assignment]
            driver.batched = proven and batched
            try:
                for p in blobs:
                    warm(p)
                spent[0] = 0.0
                t = time.perf_counter()
                first_step(store.restore("s", identity=IDENTITY).cache)
                dt = time.perf_counter() - t
            finally:
                lane_cls.place = place  # type: ignore[method-assign]
                driver.batched = proven
                for lane, stream in zip(ring.lanes, streams, strict=True):
                    lane.stream = stream  # type: ignore[attr-defined]
            best[name] = min(best.get(name, 1e9), dt)
            if fn is timed:
                placing[name] = min(placing.get(name, 1e9), spent[0])
        for name, (setup, op) in limits.items():  # the machine's limits, same rounds
            if setup is not None:
                setup()
            t = time.perf_counter()
            op()
            best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    for name, dt in best.items():
        ratio = f" ({dt / best[WARM_LIMIT]:.2f}x the warm limit)" if name not in limits else ""
        label = name if name in limits else f"restore + step, {name}"
        lines.append(f"{label}: {dt * 1000:.1f} ms{ratio}")
    for name, dt in placing.items():
        lines.append(f"{name}: time inside Lane.place, summed over lanes: {dt * 1000:.1f} ms")
    lines.extend(_parts_of_a_restore(store, blobs))
    for name, on in (("batched", True), ("strided", False)):  # every byte where it was
        driver.batched = proven and on
        got = store.restore("s", identity=IDENTITY).cache
        want = llama(8192)
        same = all(
            mx.array_equal(g.state[0][..., :8192, :], w.state[0]).item()
            and mx.array_equal(g.state[1][..., :8192, :], w.state[1]).item()
            for g, w in zip(got, want, strict=True)
        )
        lines.append(f"restore with {name} copies equals the saved cache: {same}")
    driver.batched = proven
    del scratch


def _parts_of_a_restore(store: persist.Store, blobs: list[Path]) -> list[str]:
    """Where a restore + first step's time goes: the restore alone, the step alone,
    and the tensors' zeroed buffers alone (what a restore makes before any read)."""
    sizes = [16 << 20] * TENSORS  # an 8k cache's keys and values: 8 x 8192 x 128 bf16
    best = {"restore alone": 1e9, "first step alone": 1e9, "zeroed buffers + addresses": 1e9}
    for _ in range(REPS):
        for p in blobs:
            warm(p)
        t = time.perf_counter()
        cache = store.restore("s", identity=IDENTITY).cache
        mx.synchronize()
        t1 = time.perf_counter()
        first_step(cache)
        t2 = time.perf_counter()
        del cache
        made = addressing.zeroed(sizes)
        t3 = time.perf_counter()
        del made
        t4 = time.perf_counter()
        made = addressing.zeroed(sizes)
        t5 = time.perf_counter()
        del made
        for name, dt in zip(best, (t1 - t, t2 - t1, min(t3 - t2, t5 - t4)), strict=True):
            best[name] = min(best[name], dt)
    return [f"{name}: {dt * 1000:.1f} ms" for name, dt in best.items()]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    for part in (part_a, part_b):
        start = len(lines)
        try:
            part(lines)
        except Exception as e:  # report what the other part found
            lines.append(f"{part.__name__} failed: {e!r}")
        print("\n".join(lines[start:]), flush=True)
    (out / "copy-probe.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
