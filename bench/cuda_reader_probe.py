"""Reading and hashing 1 GiB of warm files: threads or processes? (probe, host only)

python3 -m bench.cuda_reader_probe
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import xxhash

FILES, SIZE, CHUNK, PIECE, WORKERS = 32, 32 << 20, 16 << 20, 512 << 10, 8


def work(path: str, buf: memoryview, base: int, check: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for pos in range(0, SIZE, CHUNK):
            view = buf[base + pos : base + pos + CHUNK]
            assert os.preadv(fd, [view], pos) == CHUNK
            if check:
                for a in range(0, CHUNK, PIECE):
                    xxhash.xxh3_128(view[a : a + PIECE]).digest()
    finally:
        os.close(fd)


_shm: list[shared_memory.SharedMemory] = []


def attach(name: str) -> None:
    """A worker maps the region once (and faults its pages once), as a pool would."""
    _shm.append(shared_memory.SharedMemory(name=name))
    np.frombuffer(_shm[0].buf, np.uint8)[::4096].sum()


def proc_main(paths: list[str], idx: list[int], check: bool) -> None:
    view = memoryview(_shm[0].buf)
    for i in idx:
        work(paths[i], view, i * SIZE, check)
    del view


def main() -> None:
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        paths = []
        rng = np.random.default_rng(0)
        for i in range(FILES):
            p = Path(d) / f"f{i}"
            p.write_bytes(rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes())
            paths.append(str(p))
        for p in paths:
            Path(p).read_bytes()
        buf = np.empty(FILES * SIZE, np.uint8)
        view = memoryview(buf).cast("B")
        stop = threading.Event()

        def hog() -> None:  # a copier-like Python loop on the main side
            x = 0
            while not stop.is_set():
                x += 1

        def threads(check: bool, with_hog: bool) -> float:
            h = threading.Thread(target=hog) if with_hog else None
            if h:
                stop.clear()
                h.start()
            t = time.perf_counter()
            with ThreadPoolExecutor(WORKERS) as pool:
                list(pool.map(lambda i: work(paths[i], view, i * SIZE, check), range(FILES)))
            dt = time.perf_counter() - t
            if h:
                stop.set()
                h.join()
            return dt

        shm = shared_memory.SharedMemory(create=True, size=FILES * SIZE)
        ctx = mp.get_context("spawn")
        try:
            with ctx.Pool(WORKERS, initializer=attach, initargs=(shm.name,)) as pool:
                pool.map(abs, range(WORKERS))  # started

                def procs(check: bool) -> float:
                    t = time.perf_counter()
                    parts = [list(range(k, FILES, WORKERS)) for k in range(WORKERS)]
                    pool.starmap(proc_main, [(paths, ix, check) for ix in parts])
                    return time.perf_counter() - t

                rows = {
                    "threads, read only": lambda: threads(False, False),
                    "threads, read + hash": lambda: threads(True, False),
                    "threads, read + hash, a Python loop beside": lambda: threads(True, True),
                    "processes, read only": lambda: procs(False),
                    "processes, read + hash": lambda: procs(True),
                }
                best = {k: float("inf") for k in rows}
                for _ in range(4):
                    for k, fn in rows.items():
                        best[k] = min(best[k], fn())
                for k, v in best.items():
                    print(f"{k}: {v * 1e3:.1f} ms for 1 GiB")
        finally:
            shm.close()
            shm.unlink()


if __name__ == "__main__":
    main()
