"""How fast the host hashes pinned and pageable memory here (probe)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from persist.format import fasthash, pinned

N = 1 << 28


def rate(buf: np.ndarray, threads: int, new: object) -> float:
    view = memoryview(buf).cast("B")  # type: ignore[arg-type]
    step = 1 << 19

    def one(k: int) -> None:
        h = new()  # type: ignore[operator]
        for i in range(k * step, N, threads * step):
            h.update(view[i : i + step])
        h.digest()

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(3):
            t = time.perf_counter()
            list(pool.map(one, range(threads)))
            best = min(best, time.perf_counter() - t)
    return N / best / 1e9


def main() -> None:
    print("xxhash", xxhash.VERSION, "gil-free", fasthash.parallel())
    plain = np.random.default_rng(0).integers(0, 256, N, dtype=np.uint8)
    choice = pinned.choose()
    import ctypes

    host, _ = pinned._Driver().host_alloc(N)
    pin = np.ctypeslib.as_array((ctypes.c_uint8 * N).from_address(host))
    pin[:] = plain
    for name, buf in (("pageable", plain), ("pinned", pin)):
        for threads in (1, 8):
            for hname, new in (("python", xxhash.xxh3_128), ("ctypes", fasthash.new)):
                print(f"{name} {threads} threads {hname}: {rate(buf, threads, new):.1f} GB/s")
    t = time.perf_counter()
    pin[:] = plain
    print(f"memcpy pageable->pinned {N / (time.perf_counter() - t) / 1e9:.1f} GB/s", choice.path)


if __name__ == "__main__":
    main()
