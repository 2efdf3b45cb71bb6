"""Where a staged CUDA restore spends its time (probe; not a bench row).

python3 -m bench.cuda_stage_timeline [TOKENS]
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import xxhash

import persist
from bench import bench_throughput
from bench.bench_throughput import IDENTITY, llama
from bench.common import warm
from persist.engine import staging
from persist.format import pinned

spent: dict[str, float] = defaultdict(float)
count: dict[str, int] = defaultdict(int)
lock = threading.Lock()


def timed(name: str, fn: Any) -> Any:
    def inner(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                spent[name] += time.perf_counter() - t
                count[name] += 1

    return inner


def gil_check() -> None:
    a = mx.random.normal((8192, 8192))
    mx.eval(a)
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    t0, n0 = time.perf_counter(), ticks[0]
    b = a
    for _ in range(20):
        b = b @ a
    mx.eval(b)
    t1, n1 = time.perf_counter(), ticks[0]
    time.sleep(0.2)
    n2 = ticks[0]
    stop.set()
    th.join()
    print(f"spin ticks during {t1 - t0:.3f} s of mx.eval: {n1 - n0}; in 0.2 s sleep: {n2 - n1}")


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    gil_check()
    choice = pinned.choose()
    ring = choice.ring
    assert ring is not None
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        cache = llama(tokens)
        with persist.Store(Path(d) / "s") as store:
            store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
            files = list((Path(d) / "s" / "blobs").rglob("*.safetensors"))
            print(f"{len(files)} blob files, {sum(p.stat().st_size for p in files) >> 20} MiB")
            driver = pinned._Driver()
            configs = []
            for n, mib in ((16, 8), (8, 16), (16, 16)):
                r = ring if (n, mib) == (16, 8) else pinned._cuda_ring(driver, n, mib << 20)
                configs.append((f"{n}x{mib}MiB, hash True", r, 0, True))
                if mib == 16 and n == 16:
                    configs.append((f"{n}x{mib}MiB, hash False", r, 0, False))
            for name, r, _, check in configs:
                staging.xxhash = xxhash if check else _Blinded  # type: ignore[assignment]
                with pinned.use(pinned.Choice(pinned.CUDA_PINNED, "probe", r)):
                    best = float("inf")
                    for _ in range(3):
                        for p in files:
                            warm(p)
                        t = time.perf_counter()
                        bench_throughput.first_step(store.restore("s", identity=IDENTITY).cache)
                        best = min(best, time.perf_counter() - t)
                print(f"{name}: restore + step {best * 1e3:.1f} ms")
            staging.xxhash = xxhash  # type: ignore[assignment]
            import cProfile
            import pstats

            with pinned.use(pinned.Choice(pinned.CUDA_PINNED, "probe", ring)):
                for p in files:
                    warm(p)
                prof = cProfile.Profile()
                prof.enable()
                bench_throughput.first_step(store.restore("s", identity=IDENTITY).cache)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            for label, patch in (("plain", False), ("timed", True)):
                best = float("inf")
                for _ in range(3):
                    for p in files:
                        warm(p)
                    spent.clear()
                    count.clear()
                    saved = (ring.acquire, ring.to_device, os.preadv, mx.eval)
                    if patch:
                        ring.acquire = timed("acquire", ring.acquire)  # type: ignore[method-assign]
                        ring.to_device = timed("to_device", ring.to_device)
                        os.preadv = timed("preadv", os.preadv)
                        mx.eval = timed("eval", mx.eval)
                        staging.xxhash = _Timed  # type: ignore[assignment]
                        staging._cut = timed("cut", saved_cut)
                    t = time.perf_counter()
                    try:
                        got = store.restore("s", identity=IDENTITY).cache
                        t_restore = time.perf_counter() - t
                        bench_throughput.first_step(got)
                    finally:
                        ring.acquire, ring.to_device, os.preadv, mx.eval = saved  # type: ignore[method-assign,assignment]
                        staging._cut = saved_cut
                        staging.xxhash = xxhash  # type: ignore[assignment]
                    dt = time.perf_counter() - t
                    best = min(best, dt)
                    parts = ", ".join(f"{k} {v * 1e3:.1f} ms/{count[k]}" for k, v in spent.items())
                    head = f"{label}: restore {t_restore * 1e3:.1f} ms, +step {dt * 1e3:.1f} ms"
                    print(f"{head}; {parts}")


saved_cut = staging._cut


class _Any:
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


class Blind:
    """A hasher that checks nothing: the restore's speed without its checks."""

    def update(self, data: Any) -> None:
        pass

    def digest(self) -> Any:
        return _Any()


if __name__ == "__main__":
    main()


class _Blinded:
    xxh3_128 = Blind


class _Timed:
    @staticmethod
    def xxh3_128() -> Any:
        return _TimedHasher()


class _TimedHasher:
    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()
        self.update = timed("hash", self.h.update)

    def digest(self) -> bytes:
        return self.h.digest()
