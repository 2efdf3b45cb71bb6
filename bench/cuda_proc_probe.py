"""Would reader processes beat reader threads for a staged CUDA restore? (H200 probe)

    python -m bench.cuda_proc_probe OUT_DIR [tokens]

The thread pipeline's remaining cost is its readers' Python between their
GIL-free calls (bench/results/cuda-restore-r4.md).  Here the same work, read
+ hash every tensor + one copy-engine copy per 8 MiB slot, is split: worker
processes (stdlib + xxhash, started once) read and hash into slots of one
shared memfd mapping that the parent registered as pinned memory
(``cuMemHostRegister``); a parent thread per worker sends it requests over a
pipe and queues the copies.  Timed warm, minimum of interleaved repetitions,
beside Store.restore + first step through the thread lanes, and checked: the
device buffer equals the files' bytes.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import persist
from bench.common import warm
from bench.shapes import IDENTITY, first_step, llama
from persist.cuda import pinned
from persist.cuda.driver import Driver
from persist.cuda.kernels import device_buffers
from persist.format.container import read_header
from persist.format.manifest import blob_manifest

SLOT = 8 << 20
REPS = 5
WORKER = r"""
import mmap, os, sys, xxhash
m = mmap.mmap(int(sys.argv[1]), int(sys.argv[2]))
view, files = memoryview(m), {}
for line in sys.stdin:
    p = line.split()
    fd = files.get(p[0])
    if fd is None:
        fd = files[p[0]] = os.open(p[0], os.O_RDONLY)
    at, pos, n = int(p[1]), int(p[2]), int(p[3])
    ok = os.preadv(fd, [view[at : at + n]], pos) == n
    for i in range(4, len(p), 3):
        a, b = int(p[i]), int(p[i + 1])
        ok = ok and xxhash.xxh3_128_hexdigest(view[at + a : at + b]) == p[i + 2]
    sys.stdout.write("ok\n" if ok else "bad\n")
    sys.stdout.flush()
"""


def plan(files: list[Path]) -> tuple[list[tuple[Path, int, int, list[tuple[int, int, str]]]], int]:
    """Slots of whole tensors, as the restore reads them: (file, position, bytes,
    [(a, b, digest) of the tensors in it, relative to the slot]); and how many
    tensors larger than a slot go unhashed here."""
    out, unhashed = [], 0
    for p in files:
        with open(p, "rb") as f:
            header = read_header(f, str(p))
        sums = blob_manifest(header, str(p))
        tensors = sorted((e.start, e.end, sums[k].hex()) for k, e in header.tensors.items())
        i = 0
        while i < len(tensors):
            pos, held = tensors[i][0], []
            while i < len(tensors) and tensors[i][1] - pos <= SLOT:
                a, b, d = tensors[i]
                held.append((a - pos, b - pos, d))
                i += 1
            if not held:  # one tensor over a slot: its bytes in slot-sized pieces
                a, b, _ = tensors[i]
                out += [(p, x, min(SLOT, b - x), []) for x in range(a, b, SLOT)]
                unhashed, i = unhashed + 1, i + 1
                continue
            out.append((p, pos, held[-1][1], held))
    return out, unhashed


class Workers:
    """``n`` reader processes over one shared, pinned mapping of 2 slots each."""

    def __init__(self, driver: Driver, n: int) -> None:
        self.n, self.driver = n, driver
        self.fd = os.memfd_create("persist-probe")
        size = 2 * n * SLOT
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size)
        self.anchor = ctypes.c_char.from_buffer(self.map)
        self.host = ctypes.addressof(self.anchor)
        rc = driver.lib.cuMemHostRegister_v2(
            ctypes.c_void_p(self.host), ctypes.c_size_t(size), ctypes.c_uint(0x01)
        )
        if rc:
            raise OSError(f"cuMemHostRegister returned CUDA error {rc}")
        self.procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(self.fd), str(size)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(self.fd,),
                text=True,
                bufsize=1,
            )
            for _ in range(n)
        ]
        self.streams = [driver.stream() for _ in range(n)]
        self.events = [[driver.event(), driver.event()] for _ in range(n)]

    def run(
        self,
        slots: list[tuple[Path, int, list[tuple[int, int, str]]]],
        base: dict[Path, int],
        dst: int,
    ) -> bool:
        ok = [True] * self.n

        def one(w: int) -> None:
            self.driver.make_current()
            proc, stream, events = self.procs[w], self.streams[w], self.events[w]
            pending = [False, False]
            for i, (p, pos, n, held) in enumerate(slots[w :: self.n]):
                s = i % 2
                if pending[s]:
                    self.driver.wait_event(events[s])
                at = (2 * w + s) * SLOT
                sums = " ".join(f"{a} {b} {d}" for a, b, d in held)
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{p} {at} {pos} {n} {sums}\n")
                if proc.stdout.readline().strip() != "ok":
                    ok[w] = False
                self.driver.copy_in(self.host + at, dst + base[p] + pos, n, stream)
                self.driver.record(events[s], stream)
                pending[s] = True
            self.driver.wait_stream(stream)

        threads = [threading.Thread(target=one, args=(w,)) for w in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return all(ok)

    def close(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait()


def _tensor_bytes(p: Path) -> np.ndarray:
    """The file's bytes with its header zeroed (the slots copy tensor bytes only)."""
    data = np.fromfile(p, dtype=np.uint8)
    with open(p, "rb") as f:
        start = min(e.start for e in read_header(f, str(p)).tensors.values())
    data[:start] = 0
    return data


def main() -> None:
    out = Path(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    tmp = Path(tempfile.mkdtemp(dir="/var/tmp"))
    store = persist.Store(tmp / "store")
    store.save(llama(tokens), list(range(tokens)), identity=IDENTITY, session="s")
    files = sorted((tmp / "store" / "blobs").rglob("*.safetensors"))
    sizes = [p.stat().st_size for p in files]
    base = dict(zip(files, np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist(), strict=True))
    total = int(sum(sizes))
    slots, unhashed = plan(files)
    driver = Driver()
    pinned.data_path()  # MLX's context and the thread lanes, as a restore has them
    ((buf, dst),) = device_buffers([total])
    want = mx.concatenate([mx.array(_tensor_bytes(p)) for p in files])
    workers = {n: Workers(driver, n) for n in (8, 12, 16)}
    best: dict[str, float] = {}
    lines = [f"{tokens} tokens, {len(files)} blobs, {total >> 20} MiB, {len(slots)} slots"]
    lines[0] += f", {unhashed} tensors over a slot (not hashed here)"
    for rep in range(REPS + 1):
        for n, w in workers.items():
            for p in files:
                warm(p)
            t = time.perf_counter()
            good = w.run(slots, base, dst)
            dt = time.perf_counter() - t
            same = bool(mx.array_equal(buf.reshape(-1)[:total], want).item())
            if rep:
                key = f"processes: {n} readers, read + hash + copy (warm)"
                best[key] = min(best.get(key, 1e9), dt)
            if not (good and same):
                lines.append(f"FAILED: {n} readers, checksums {good}, bytes equal {same}")
        for p in files:
            warm(p)
        t = time.perf_counter()
        first_step(store.restore("s", identity=IDENTITY).cache)
        if rep:
            key = "threads: Store.restore + first step (warm)"
            best[key] = min(best.get(key, 1e9), time.perf_counter() - t)
    lines += [f"{k}: {v * 1000:.1f} ms" for k, v in best.items()]
    for w in workers.values():
        w.close()
    print("\n".join(lines))
    (out / f"proc-probe-{tokens}.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
