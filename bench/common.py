"""Benchmark helpers: timing, memory high-water marks, the machine's raw limits."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

RESULTS = Path(__file__).parent / "results"

# A 24M-parameter llama-shaped model (random weights) for time-to-first-token runs.
SMALL_LLAMA = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1408,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}

# Llama-3-8B's model shape (random weights: bench_recompute, bench_e2e)
LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}

SHAPES = {
    # layers, kv heads, head dim (bf16)
    "llama3-8b": (32, 8, 128),
    "qwen2.5-0.5b": (24, 2, 64),
}


def kv_cache(shape: str, tokens: int, seed: int = 0) -> list[Any]:
    from mlx_lm.models.cache import KVCache

    layers, heads, dim = SHAPES[shape]
    out = []
    for i in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(seed + i)).astype(
            mx.bfloat16
        )
        c.update_and_fetch(k, k * 0.5)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def live_bytes(cache: list[Any]) -> int:
    return sum(2 * c.keys[..., : c.offset, :].nbytes for c in cache)


def evict(path: Path) -> None:
    """Drop a file's pages from the page cache (for cold reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    """Read a file once so its pages are in the page cache (saves may bypass it)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def raw_write(path: Path, buf: memoryview, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(buf)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def direct_write(path: Path, buf: memoryview) -> None:
    """A new file through O_DIRECT from an aligned buffer, as persist's writer does."""
    import mmap

    stage = mmap.mmap(-1, 8 << 20)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        view = memoryview(stage)
        for i in range(0, buf.nbytes - buf.nbytes % len(stage), len(stage)):
            view[:] = buf[i : i + len(stage)]
            os.write(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)
        del view
        stage.close()


def raw_read(path: Path, into: bytearray) -> None:
    with open(path, "rb", buffering=0) as f:
        f.readinto(into)


def raw_ops(
    nbytes: int, tmp: Path
) -> dict[str, tuple[Callable[[], Any] | None, Callable[[], Any]]]:
    """The machine's raw operations on ``nbytes``, as (setup, op) pairs to time."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    buf = memoryview(src)
    path, st = tmp / "raw.bin", tmp / "raw.safetensors"
    raw_write(path, buf, True)
    mx.save_safetensors(str(st), {"x": mx.array(src)})
    dst = bytearray(nbytes)
    copy = np.empty_like(src)
    return {
        "page-cache write": (None, lambda: raw_write(path, buf, False)),
        "write+fsync": (None, lambda: raw_write(path, buf, True)),
        "O_DIRECT write+fsync (new file)": (None, lambda: direct_write(tmp / "direct.bin", buf)),
        "warm read": (None, lambda: raw_read(path, dst)),
        "cold read": (lambda: evict(path), lambda: raw_read(path, dst)),
        "warm read into MLX (mx.load)": (None, lambda: mx.eval(mx.load(str(st))["x"])),
        "memcpy": (None, lambda: np.copyto(copy, src)),
    }


def interleaved(
    ops: dict[str, tuple[Callable[[], Any] | None, Callable[[], Any]]], reps: int
) -> dict[str, float]:
    """Median seconds per op, running the ops round-robin so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for setup, fn in ops.values():  # warm-up round, not timed
        if setup:
            setup()
        fn()
    for _ in range(reps):
        for name, (setup, fn) in ops.items():
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


@contextlib.contextmanager
def peak_above() -> Iterator[dict[str, int]]:
    """Peak resident bytes reached inside the block, above resident bytes at its start."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    base = rss_kib()
    out: dict[str, int] = {}
    yield out
    out["peak_above_bytes"] = (rss_kib("VmHWM") - base) * 1024


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
    }


def write_results(name: str, data: dict[str, Any], markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
