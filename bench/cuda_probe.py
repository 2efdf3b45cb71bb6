"""Which MLX op gives a GPU array a buffer of its own after the host touched the old one.

On MLX's CUDA backend a host read (numpy, memoryview) moves an array's buffer into
managed memory, and later kernels on it slow down.  This probe times a reduction
over a 4 GiB array before and after a host read, and over copies made by a few ops.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np


def timed(a: mx.array | list[mx.array]) -> float:
    arrays = a if isinstance(a, list) else [a]
    best = float("inf")
    for _ in range(3):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([x.sum() for x in arrays])
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def at_scale(n: int) -> None:
    """A 16 GiB cache's worth of arrays: host-read them all, as a save does."""
    arrays = [mx.random.normal((1, 8, 131072, 128)).astype(mx.bfloat16) for _ in range(n)]
    mx.eval(arrays)
    print(n, "arrays resident", round(timed(arrays) * 1e3, 1), "ms")
    views = [np.asarray(memoryview(a.view(mx.uint16))) for a in arrays]
    print("host sums", sum(int(v[0, 0, 0, 0]) for v in views))
    print("after host reads, views alive", round(timed(arrays) * 1e3, 1), "ms")
    del views
    print("after host reads, views gone", round(timed(arrays) * 1e3, 1), "ms")
    copies = [a + 0 for a in arrays]
    mx.eval(copies)
    print("copies (a + 0)", round(timed(copies) * 1e3, 1), "ms")


def main() -> None:
    a = mx.random.normal((1, 8, 131072, 128)).astype(mx.bfloat16) * 1
    mx.eval(a)
    print("device resident", round(timed(a) * 1e3, 2), "ms")
    host = np.asarray(memoryview(a.view(mx.uint16)))
    print("host read", host.shape, host[0, 0, 0, 0])
    print("after a host read", round(timed(a) * 1e3, 2), "ms")
    ops = {
        "a + 0": lambda x: x + 0,
        "mx.array(a)": lambda x: mx.array(x),
        "a.astype(same)": lambda x: x.astype(x.dtype),
        "concatenate": lambda x: mx.concatenate([x, x[..., :0, :]], axis=2),
        "copy.copy": lambda x: __import__("copy").copy(x),
    }
    for name, op in ops.items():
        b = op(a)
        mx.eval(b)
        print(name, round(timed(b) * 1e3, 2), "ms", "same buffer" if b is a else "")
    c = mx.zeros(a.shape, dtype=a.dtype)
    mx.eval(c)
    view = memoryview(c)  # what a restore does: fill a buffer from the host
    del view
    print("zeros written from the host", round(timed(c) * 1e3, 2), "ms")
    print("its copy (a + 0)", round(timed(c + 0) * 1e3, 2), "ms")


if __name__ == "__main__":
    main()
    at_scale(64)
