"""The CUDA restore path on the machine itself: is it right, and which ring is fastest?

    python3 -m bench.cuda_restore_probe [OUT_DIR] [--geometry]

1. the data path this process chose, and the copy kernel on odd sizes (bit-equal);
2. a store restore through the ring of a Llama-3-8B-shaped cache (1k and 8k
   tokens), state bytes against the saved cache, and whether its buffers are
   device memory (a reduction over them before and after, against a prefilled one);
3. restore + first step, warm, with a few settings of the staged read (copies
   in flight, reader threads); with --geometry also for rings of several
   geometries and the host path, with the time spent in each stage.
Prints a report and writes it to OUT_DIR/cuda-restore-probe.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import persist
from bench import bench_throughput
from bench.bench_throughput import IDENTITY, llama
from bench.common import warm
from persist.engine import loading, reading, staging
from persist.format import pinned

LINES: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def kernel_check() -> None:
    choice = pinned.choose()
    say(f"data path: {choice.describe()}")
    ring = choice.ring
    assert ring is not None, "the CUDA path was not chosen"
    rng = np.random.default_rng(0)
    for n in (1, 15, 16, 4097, ring.slot_bytes - 3, ring.slot_bytes):
        src = rng.integers(0, 256, n, dtype=np.uint8)
        ring.slots[0][:n] = src
        out = ring.to_device(0, n)
        mx.eval(out)
        got = np.array(out[:n])
        assert got.tobytes() == src.tobytes(), f"copy of {n} bytes differs"
    say("copy kernel: bit-equal for 1, 15, 16, 4097, slot-3, slot bytes")


def state_bytes(cache: list[Any]) -> list[bytes]:
    out = []
    for c in cache:
        for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :]):
            out.append(bytes(np.array(a.view(mx.uint16))))
    return out


def reduce_s(cache: list[Any]) -> float:
    arrays = [a for c in cache for a in (c.keys, c.values)]
    best = float("inf")
    for _ in range(3):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([a.astype(mx.float32).sum() for a in arrays])
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def restore_check(tmp: Path, tokens: int) -> None:
    cache = llama(tokens)
    want = state_bytes(cache)
    fresh = reduce_s(cache)
    with persist.Store(tmp / f"c{tokens}") as store:
        store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
        got = store.restore("s", identity=IDENTITY).cache
        assert state_bytes(got) == want, "restored state differs"
        restored = reduce_s(got)
        path = store.stats().data_paths
    say(
        f"{tokens} tokens: state bit-equal; a reduction over every buffer "
        f"{restored * 1e3:.1f} ms restored vs {fresh * 1e3:.1f} ms prefilled-like; {path}"
    )


def geometry(tmp: Path, tokens: int, reps: int = 4) -> None:
    cache = llama(tokens)
    store = persist.Store(tmp / f"g{tokens}")
    store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
    files = list((tmp / f"g{tokens}" / "blobs").rglob("*.safetensors"))
    spent: dict[str, list[float]] = {}
    patched = [
        (staging, "stage"),
        (staging, "assemble"),
        (reading, "load_snapshot"),
        (loading, "rebuild"),
        (bench_throughput, "first_step"),
    ]
    real = {name: getattr(mod, name) for mod, name in patched}

    def timer(name: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = real[name](*a, **k)
            spent.setdefault(name, []).append(time.perf_counter() - t)
            return out

        return timed

    for mod, name in patched:
        setattr(mod, name, timer(name))
    driver = pinned._Driver()
    rings: dict[str, pinned.Choice] = {"host path": pinned.Choice(pinned.HOST, "probe")}
    for n, mib in ((16, 4), (8, 16), (16, 8)):
        ring = pinned._cuda_ring(driver, n, mib << 20)
        rings[f"{n} x {mib} MiB"] = pinned.Choice(pinned.CUDA_PINNED, "probe", ring)
    try:
        for name, choice in rings.items():
            best, parts = float("inf"), ""
            with pinned.use(choice):
                for _ in range(reps):
                    for p in files:
                        warm(p)
                    spent.clear()
                    t = time.perf_counter()
                    bench_throughput.first_step(store.restore("s", identity=IDENTITY).cache)
                    dt = time.perf_counter() - t
                    if dt < best:
                        best = dt
                        parts = ", ".join(f"{k} {sum(v) * 1e3:.1f}" for k, v in spent.items())
            say(f"{tokens} tokens, {name}: restore + step (warm) {best * 1e3:.1f} ms ({parts} ms)")
    finally:
        for mod, name in patched:
            setattr(mod, name, real[name])
        store.close()


def pipeline(tmp: Path, tokens: int, reps: int = 3) -> None:
    """The staged read's knobs on the default ring: copies in flight, reader threads."""
    cache = llama(tokens)
    with persist.Store(tmp / f"p{tokens}") as store:
        store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
        files = list((tmp / f"p{tokens}" / "blobs").rglob("*.safetensors"))
        knobs = (staging.IN_FLIGHT, staging.READERS)
        try:
            for in_flight, readers in ((2, 8), (8, 8), (2, 12), (2, 4), (8, 12)):
                staging.IN_FLIGHT, staging.READERS = in_flight, readers
                best = float("inf")
                for _ in range(reps):
                    for p in files:
                        warm(p)
                    t = time.perf_counter()
                    bench_throughput.first_step(store.restore("s", identity=IDENTITY).cache)
                    best = min(best, time.perf_counter() - t)
                say(
                    f"{tokens} tokens, {in_flight} copies in flight, {readers} readers: "
                    f"restore + step (warm) {best * 1e3:.1f} ms"
                )
        finally:
            staging.IN_FLIGHT, staging.READERS = knobs


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = Path(args[0]) if args else None
    kernel_check()
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        for n in (1024, 8192):
            restore_check(tmp, n)
        pipeline(tmp, 8192)
        if "--geometry" in sys.argv:
            geometry(tmp, 8192)
            geometry(tmp, 32768, reps=2)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "cuda-restore-probe.md").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
