"""Where a staged CUDA restore's time goes (H200 probe; writes a report to argv[1]).

    python -m bench.cuda_stage_probe OUT_DIR [tokens]

A Llama-3-8B-shaped cache is saved once; then, warm, minimum of interleaved
repetitions: Store.restore + first step through lanes of several counts and
slot sizes, and one instrumented restore per ring that sums, over the reader
threads, the time in preadv, xxhash, queuing copies and waiting for a slot;
beside them the floor: the store's blob files read and hashed per tensor on
the same threads with no copies.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

import persist
from bench.common import warm
from bench.shapes import IDENTITY, first_step, llama
from persist.cuda import pinned, reader_worker
from persist.cuda.driver import Driver
from persist.engine import loading
from persist.engine.staged import restore as staging
from persist.engine.staged import slot_reads

REPS = 3
_sums: dict[str, float] = defaultdict(float)
_spans: list[tuple[int, str, float, float]] = []  # (thread, what, start, end)
_lock = threading.Lock()


def _add(name: str, dt: float, start: float | None = None) -> None:
    with _lock:
        _sums[name] += dt
        if start is not None:
            _spans.append((threading.get_ident(), name, start, start + dt))


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _add(name, time.perf_counter() - t, t)

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def timeline() -> str:
    """The reader threads inside the stage: when the first and last started and
    ended (ms from the stage's start), their timed calls against their lifetime,
    and the time no reader was in a timed call."""
    stage = [s for s in _spans if s[1] == "stage"]
    if not stage:
        return "no stage"
    t0, t1 = stage[0][2], stage[0][3]
    per: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
    for tid, what, a, b in _spans:
        if what not in ("stage", "buffers", "scatter"):
            per[tid].append((what, a, b))
    firsts = sorted(min(a for _, a, _ in v) - t0 for v in per.values())
    lasts = sorted(max(b for _, _, b in v) - t0 for v in per.values())
    life = sum(max(b for _, _, b in v) - min(a for _, a, _ in v) for v in per.values())
    timed = sum(b - a for v in per.values() for _, a, b in v)
    edges = sorted(
        [(a, 1) for v in per.values() for _, a, _ in v]
        + [(b, -1) for v in per.values() for _, _, b in v]
    )
    idle, depth, last = 0.0, 0, t0
    for at, d in edges:
        if depth == 0:
            idle += at - last
        depth += d
        last = at
    idle += max(0.0, t1 - last)
    ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
    return (
        f"stage {ms(t1 - t0)} ms, {len(per)} readers; first calls at {[ms(x) for x in firsts]}; "
        f"last ends at {[ms(x) for x in lasts]}; reader lifetimes {ms(life)}, in timed calls "
        f"{ms(timed)}; no reader in a call for {ms(idle)} ms of the stage"
    )


class _Hasher:
    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()

    def update(self, b: Any) -> None:
        t = time.perf_counter()
        self.h.update(b)
        _add("xxhash", time.perf_counter() - t)

    def digest(self) -> bytes:
        return self.h.digest()


def instrumented(ring: pinned.Ring, fn: Callable[[], None]) -> dict[str, float]:
    _sums.clear()
    saved = (reader_worker.os, reader_worker.xxhash, staging.stage, ring.scatter, ring.buffers)
    reader_worker.os = types.SimpleNamespace(preadv=_timed("preadv", os.preadv))  # type: ignore[assignment]
    reader_worker.xxhash = types.SimpleNamespace(  # type: ignore[assignment]
        xxh3_128=_Hasher, xxh3_128_digest=_timed("xxhash", xxhash.xxh3_128_digest)
    )
    lanes = [(lane, lane.put, lane.take) for lane in ring.lanes]
    for lane, put, take in lanes:
        lane.put = _timed("put", put)  # type: ignore[method-assign]
        lane.take = _timed("take", take)  # type: ignore[method-assign]
        if hasattr(lane, "answer"):  # a reader process: the wait for its answers
            lane.answer = _timed("fill", lane.answer)  # type: ignore[attr-defined]
    fills = [getattr(lane, "answer", None) for lane in ring.lanes]
    ring.buffers = _timed("buffers", ring.buffers)  # type: ignore[method-assign]
    ring.scatter = _timed("scatter", ring.scatter)  # type: ignore[method-assign]
    loading.staging.stage = _timed("stage", staging.stage)  # type: ignore[attr-defined]
    opener = loading._open_staged
    loading._open_staged = _timed("open", opener)  # type: ignore[assignment]
    lane_fn = staging._lane

    def lane(*a: Any) -> None:  # the CPU each lane's thread spends (GIL and system time)
        c = time.thread_time()
        try:
            lane_fn(*a)
        finally:
            _add("lane cpu", time.thread_time() - c)

    staging._lane = lane  # type: ignore[assignment]
    _spans.clear()
    try:
        t, c = time.perf_counter(), time.process_time()
        fn()
        _sums["total"] = time.perf_counter() - t
        _sums["parent cpu"] = time.process_time() - c
    finally:
        staging._lane = lane_fn  # type: ignore[assignment]
        reader_worker.os, reader_worker.xxhash = saved[0], saved[1]  # type: ignore[assignment]
        staging.stage = saved[2]  # type: ignore[assignment]
        loading._open_staged = opener  # type: ignore[assignment]
        ring.buffers, ring.scatter = saved[4], saved[3]  # type: ignore[method-assign]
        for (lane, _, _), fill in zip(lanes, fills, strict=True):
            del lane.put, lane.take  # type: ignore[attr-defined]
            if fill is not None:
                lane.answer = fill.__wrapped__  # type: ignore[attr-defined]
    return dict(_sums)


def floor(
    files: list[Path], threads: int, slot: int, bufs: list[np.ndarray] | None = None
) -> float:
    """Read + hash per 512 KiB of every file into reused host slots (``bufs``,
    pageable unless given), no copies."""
    bufs = bufs or [np.empty(slot, dtype=np.uint8) for _ in range(threads)]
    idx = iter(range(10**9))
    lock = threading.Lock()

    def one(p: Path) -> None:
        with lock:
            i = next(idx) % threads
        view = memoryview(bufs[i]).cast("B")  # type: ignore[arg-type]
        fd = os.open(p, os.O_RDONLY)
        try:
            pos, size = 0, p.stat().st_size
            while pos < size:
                n = os.preadv(fd, [view[: min(slot, size - pos)]], pos)
                for a in range(0, n, 512 << 10):
                    xxhash.xxh3_128(view[a : min(n, a + (512 << 10))]).digest()
                pos += n
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, files))
    return time.perf_counter() - t


class _Equal(bytes):
    """A digest equal to every checksum: the ablation without hashing."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = bytes.__hash__


class _NoHasher:
    def update(self, b: Any) -> None:
        pass

    def digest(self) -> bytes:
        return _Equal()


_NO_HASH = types.SimpleNamespace(xxh3_128=_NoHasher, xxh3_128_digest=lambda b: _Equal())


@contextlib.contextmanager
def ablated(ring: pinned.Ring, copies: bool, hashing: bool) -> Iterator[None]:
    """The staged restore without its copies (lanes and scatter do nothing) and/or
    without hashing: which part of the time each one is (the state is not checked)."""
    saved = (reader_worker.xxhash, ring.scatter, [lane.put for lane in ring.lanes])
    if not hashing:  # thread readers only: a reader process hashes in its own interpreter
        reader_worker.xxhash = _NO_HASH  # type: ignore[assignment]
    if not copies:
        ring.scatter = lambda staged, placed: None  # type: ignore[method-assign]
        for lane in ring.lanes:
            lane.put = lambda slot, dst, n: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        reader_worker.xxhash, ring.scatter = saved[0], saved[1]  # type: ignore[assignment,method-assign]
        for lane in ring.lanes:
            if not copies:
                del lane.put  # type: ignore[attr-defined]


@contextlib.contextmanager
def setting(piece: int, switch: float | None = None) -> Iterator[None]:
    """slot_reads.PIECE (bytes a reader thread reads before hashing) and the
    interpreter's GIL switch interval for the block."""
    saved = (slot_reads.PIECE, sys.getswitchinterval())
    slot_reads.PIECE = piece
    if switch is not None:
        sys.setswitchinterval(switch)
    try:
        yield
    finally:
        slot_reads.PIECE = saved[0]
        sys.setswitchinterval(saved[1])


WHOLE = 1 << 40  # a piece as large as the slot: read the slot, then hash it


def main() -> None:
    out = Path(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    tmp = Path(tempfile.mkdtemp(dir="/var/tmp"))
    store = persist.Store(tmp / "store")
    cache = llama(tokens)
    store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
    del cache
    files = sorted((tmp / "store" / "blobs").rglob("*.safetensors"))
    say(f"{tokens} tokens, {len(files)} blobs, {sum(p.stat().st_size for p in files) >> 20} MiB")
    driver = Driver()
    rings = {
        f"{n} {kind} x {mib} MiB": pinned._cuda_ring(driver, n, mib << 20, kind == "processes")
        for n, mib, kind in [
            (8, 8, "threads"),
            (8, 8, "processes"),
            (8, 4, "processes"),
            (16, 4, "processes"),
            (8, 16, "processes"),
        ]
    }
    os.environ["PERSIST_READ_PIECE"] = str(WHOLE)  # its workers read whole slots
    rings["8 processes x 8 MiB, whole-slot reads"] = pinned._cuda_ring(driver, 8, 8 << 20, True)
    del os.environ["PERSIST_READ_PIECE"]
    main_ring = rings["8 threads x 8 MiB"]
    procs = rings["8 processes x 8 MiB"]
    pinned_slots = [s for lane in main_ring.lanes for s in lane.slots[:1]]

    def restore(ring: pinned.Ring) -> Callable[[], None]:
        def go() -> None:
            with pinned.use(pinned.Choice(pinned.CUDA_PINNED, "probe", ring)):
                first_step(store.restore("s", identity=IDENTITY).cache)

        return go

    MiB = 1 << 20
    cases: list[tuple[str, pinned.Ring, int, float | None, bool, bool]] = [
        (name, ring, MiB, None, True, True) for name, ring in rings.items()
    ]
    cases += [
        ("8 threads x 8 MiB, piece whole slot", main_ring, WHOLE, None, True, True),
        ("8 processes x 8 MiB, no copies", procs, MiB, None, False, True),
        ("8 threads x 8 MiB, no copies", main_ring, MiB, None, False, True),
    ]
    best: dict[str, float] = defaultdict(lambda: float("inf"))
    for rep in range(REPS + 1):
        for name, ring, piece, switch, copies, hashing in cases:
            for p in files:
                warm(p)
            with setting(piece, switch), ablated(ring, copies, hashing):
                t = time.perf_counter()
                restore(ring)()
                if rep:
                    best[name] = min(best[name], time.perf_counter() - t)
        if rep:
            for name, bufs in [("pageable", None), ("pinned", pinned_slots)]:
                key = f"floor: read+hash, 8 threads, {name} slots"
                best[key] = min(best[key], floor(files, 8, 8 << 20, bufs))
    for name, s in best.items():
        say(f"{name}: {s * 1000:.1f} ms")
    for label, ring in [("8 threads x 8 MiB", main_ring), ("8 processes x 8 MiB", procs)]:
        got = instrumented(ring, restore(ring))
        parts = ", ".join(f"{k} {v * 1000:.1f}" for k, v in sorted(got.items()))
        say(f"instrumented {label} (ms; reader sums over threads): {parts}")
        say(f"  timeline: {timeline()}")
    mx.synchronize()
    (out / f"stage-probe-{tokens}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
