"""Save and restore against the hardware limit, as ratios, in one run.

    python -m bench.bench_throughput                 # 1k, 8k, 32k Llama-3-8B + Qwen3-Next hybrid
    python -m bench.bench_throughput --quick         # 1k and 8k Llama-3-8B only
    python -m bench.bench_throughput --prefill       # adds prefill time on a real model (GPU)
    python -m bench.bench_throughput --mlx-cache mlx # MLX's own CPU buffer cache (32 MiB)

For every case: store save / save_file / mlx-lm save+fsync / raw write+fsync;
the default path (bench/default_path: a Store per operation, MLX's default buffer
cache, in a child process): its save and its cold restore + first step;
restore + first decode step, warm and cold / load_file / mlx-lm load + the same
step / raw read; a partial hit (1/8 of the tokens): bytes and time against a
full restore; turn n+1 (256 new tokens): time and bytes against a full save (and
the time of the next turn through a Store opened for it);
peak memory above the cache.  Minimum of interleaved repetitions.  Results in
bench/results/throughput-<device>.json and .md.

The process keeps freed MLX buffers for reuse as ``persist serve`` does
(``keep_freed_buffers``; the same for persist, mlx-lm and the raw reads, which
reuse one buffer); ``--mlx-cache mlx`` measures MLX's CPU default instead,
where every load faults in fresh memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

import persist
from bench import default_path
from bench.common import RESULTS, direct_write, evict, raw_read, raw_write, warm
from bench.shapes import IDENTITY, first_step, llama, qwen3_next
from persist.serve.app import keep_freed_buffers

Op = tuple[Callable[[], Any] | None, Callable[[], Any]]


def fresh_read(path: Path) -> None:
    """A cold read into memory allocated for it, as every restore must (fresh pages)."""
    buf = np.empty(path.stat().st_size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(buf))


def read_files(paths: list[Path], scratch: list[bytearray]) -> None:
    """The store's blob files as the disk gives them: 4 threads, reused buffers (where
    on the disk a store's files land differs from one large file written at once)."""

    def one(i: int) -> None:
        buf = memoryview(scratch[i % len(scratch)])
        with open(paths[i], "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(len(scratch)) as pool:
        list(pool.map(one, range(len(paths))))


def load_file(path: Path) -> list[Any]:
    return list(persist.load_file(path).cache)


def mlx_load(path: Path) -> list[Any]:
    return list(load_prompt_cache(str(path)))


def evaluate(r: Any) -> None:
    mx.eval([c.state for c in r.cache])


def extend(cache: list[Any], new: int) -> None:
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):
            _, h, _, d = c.keys.shape
            k = mx.random.normal((1, h, new, d), key=mx.random.key(1000 + i)).astype(mx.bfloat16)
            c.update_and_fetch(k, k)
    mx.eval([c.state for c in cache])


class Peak:
    """Peak resident memory of this process while a block runs (sampled every 2 ms)."""

    def __enter__(self) -> Peak:
        import psutil

        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self.done = True
        self.thread.join()

    @property
    def above(self) -> int:
        return self.peak - self.base


def minimum(ops: dict[str, Op], reps: int) -> dict[str, float]:
    """Minimum seconds per op over ``reps`` interleaved rounds (after a warm-up round)."""
    best = dict.fromkeys(ops, float("inf"))
    for round_ in range(reps + 1):
        for name, (setup, fn) in ops.items():
            if setup is not None:
                setup()
            gc.collect()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if round_:
                best[name] = min(best[name], dt)
    return best


RESTORE_ROWS = ("store restore + step", "limit:", "raw read of its blob files")


def case(
    name: str,
    build: Callable[[int], list[Any]],
    tokens: int,
    tmp: Path,
    reps: int,
    restore_only: bool = False,
) -> dict[str, Any]:
    cache = build(tokens)
    toks = list(range(tokens))
    f, m = tmp / "f.safetensors", tmp / "m.safetensors"
    store = persist.Store(tmp / "store")
    persist.save_file(f, cache, toks)
    save_prompt_cache(str(m), cache)
    nbytes = f.stat().st_size
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    raw_path, dst = tmp / "raw.bin", bytearray(nbytes)
    scratch = [bytearray(64 << 20) for _ in range(4)]
    raw_write(raw_path, memoryview(src), True)

    def fresh_save() -> None:
        store.save(cache, toks, identity=IDENTITY, session="s")

    def drop() -> None:
        if store.has_session("s"):
            store.delete("s")

    def restore_step() -> None:
        first_step(store.restore("s", identity=IDENTITY).cache)

    def blobs() -> list[Path]:
        return list((tmp / "store" / "blobs").rglob("*.safetensors"))

    def mlx_save() -> None:
        save_prompt_cache(str(m), cache)
        fd = os.open(m, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    fresh_save()
    child = default_path.DefaultPath(name, tokens, tmp / "default")
    defaults = default_path.ops(child)
    ops: dict[str, Op] = {
        "store save": (drop, fresh_save),
        default_path.SAVE: defaults[default_path.SAVE],
        "save_file": (None, lambda: persist.save_file(f, cache, toks)),
        "mlx-lm save + fsync": (None, mlx_save),
        "raw write+fsync": (None, lambda: raw_write(raw_path, memoryview(src), True)),
        "raw O_DIRECT write+fsync": (None, lambda: direct_write(tmp / "d.bin", memoryview(src))),
    }
    if not store.has_session("s"):
        fresh_save()
    ops |= {
        "store restore + step (warm)": (lambda: [warm(p) for p in blobs()], restore_step),
        "load_file + step (warm)": (
            lambda: warm(f),
            lambda: first_step(load_file(f)),
        ),
        "mlx-lm load + step (warm)": (
            lambda: warm(m),
            lambda: first_step(mlx_load(m)),
        ),
        "raw read (warm)": (lambda: warm(raw_path), lambda: raw_read(raw_path, dst)),
        "store restore + step (cold)": (lambda: [evict(p) for p in blobs()], restore_step),
        default_path.RESTORE: defaults[default_path.RESTORE],
        "load_file + step (cold)": (
            lambda: evict(f),
            lambda: first_step(load_file(f)),
        ),
        "mlx-lm load + step (cold)": (
            lambda: evict(m),
            lambda: first_step(mlx_load(m)),
        ),
        "raw read (cold)": (lambda: evict(raw_path), lambda: raw_read(raw_path, dst)),
        "raw read into new memory (cold)": (lambda: evict(raw_path), lambda: fresh_read(raw_path)),
        "raw read of its blob files (cold)": (
            lambda: [evict(p) for p in blobs()],
            lambda: read_files(blobs(), scratch),
        ),
    }
    if device() == "cuda":  # the machine's own limits, in the same rounds
        from bench import cuda_limits

        ops |= cuda_limits.rows(blobs)
    if restore_only:  # the restore and its limits (a 4 GiB case within a device call)
        fresh_save()
        ops = {k: v for k, v in ops.items() if k.startswith(RESTORE_ROWS)}
    try:
        times = minimum(ops, reps)
    finally:
        child.close()
    if not store.has_session("s"):
        fresh_save()
    if restore_only:
        store.close()
        return {
            "case": name,
            "tokens": tokens,
            "cache_bytes": nbytes,
            "store_bytes": sum(p.stat().st_size for p in blobs()),
            "seconds": times,
            "partial": None,
            "turn": None,
            "peak_above_cache": None,
        }
    out = {
        "case": name,
        "tokens": tokens,
        "cache_bytes": nbytes,
        "store_bytes": sum(p.stat().st_size for p in blobs()),
        "seconds": times,
        "partial": partial(store, toks, reps),
        "turn": turn(store, cache, toks, tmp),
    }
    toks = [*toks, *range(len(toks), len(toks) + 512)]  # turn() grew the cache twice
    with Peak() as save_peak:
        info = store.save(cache, toks, identity=IDENTITY, session="peak")
    cache.clear()  # the ops above hold the list, not its layers
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    with Peak() as restore_peak:
        r = store.restore("peak", identity=IDENTITY)
        mx.eval([c.state for c in r.cache])
    restored = mx.get_active_memory() - before  # the restored cache, capacity included
    peak = mx.get_peak_memory() - before
    del r
    out["peak_above_cache"] = {
        "save": save_peak.above,
        "restore": peak - restored,
        "restore_host": restore_peak.above,  # resident host memory (CUDA: above nothing)
    }
    out["peak_session_bytes"] = info.bytes
    store.close()
    return out


def partial(store: persist.Store, toks: list[int], reps: int) -> dict[str, Any] | None:
    """A lookup hit of 1/8 of a session's tokens, against restoring it whole (None: the
    cache cannot be cut, as a hybrid's recurrent state: it resumes at checkpoints)."""
    k = max(16, len(toks) // 8)
    prompt = [*toks[:k], 7, 7]
    if store.find(prompt, identity=IDENTITY) is None:
        return None
    read: list[int] = []
    real_open = store.blobs.open

    def counting(file: str) -> Any:
        read.append(store.blobs.path(file).stat().st_size)
        return real_open(file)

    store.blobs.open = counting  # type: ignore[method-assign]
    try:
        times = minimum(
            {
                "hit": (
                    None,
                    lambda: mx.eval(
                        [c.state for c in store.lookup(prompt, identity=IDENTITY).cache]
                    ),
                ),  # type: ignore[union-attr]
                "full": (
                    None,
                    lambda: evaluate(store.restore("s", identity=IDENTITY)),
                ),
            },
            reps,
        )
        read.clear()
        store.lookup(prompt, identity=IDENTITY)
        hit_bytes = sum(read)
        read.clear()
        store.restore("s", identity=IDENTITY)
        full_bytes = sum(read)
    finally:
        del store.blobs.open
    return {
        "hit_tokens": k,
        "hit_s": times["hit"],
        "full_s": times["full"],
        "hit_bytes": hit_bytes,
        "full_bytes": full_bytes,
    }


def turn(
    store: persist.Store, cache: list[Any], toks: list[int], tmp: Path, new: int = 256
) -> dict[str, Any]:
    """Saving a session one turn later (``new`` tokens more) against a full save of it."""
    store.save(cache, toks, identity=IDENTITY, session="t")  # turn n
    extend(cache, new)  # the conversation goes on, in the same cache
    longer = [*toks, *range(len(toks), len(toks) + new)]
    before = store.stats().unique_bytes
    t = time.perf_counter()
    store.save(cache, longer, identity=IDENTITY, session="t")
    inc = time.perf_counter() - t
    grew = store.stats().unique_bytes - before
    extend(cache, new)  # once more, through a Store opened for the turn (the README's idiom)
    longer = [*longer, *range(len(longer), len(longer) + new)]
    with persist.Store(store.root, block_tokens=store.block_tokens) as per_turn:
        t = time.perf_counter()
        per_turn.save(cache, longer, identity=IDENTITY, session="t")
        inc_new_store = time.perf_counter() - t
    with persist.Store(tmp / "full") as other:  # nothing to share with
        t = time.perf_counter()
        other.save(cache, longer, identity=IDENTITY, session="t")
        full = time.perf_counter() - t
        full_bytes = other.stats().unique_bytes
    return {
        "new_tokens": new,
        "turn_s": inc,
        "turn_new_store_s": inc_new_store,
        "full_s": full,
        "grew_bytes": grew,
        "full_bytes": full_bytes,
    }


def _arrays(x: Any) -> list[Any]:
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for v in x for a in _arrays(v)]
    return []


def device() -> str:
    d = mx.default_device()
    if d.type == mx.gpu and mx.cuda.is_available():
        return "cuda"
    return "metal" if d.type == mx.gpu else "cpu"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--label", default=None)
    ap.add_argument("--cases", nargs="+", default=None, help="e.g. llama3-8b:32768 qwen3-next:8192")
    ap.add_argument("--mlx-cache", choices=["serve", "mlx"], default="serve")
    ap.add_argument(
        "--restore-only", action="store_true", help="only the restore rows and their limits"
    )
    args = ap.parse_args()
    if args.mlx_cache == "serve":
        keep_freed_buffers(None)
    builds = {"llama3-8b": llama, "qwen3-next": qwen3_next}
    cases: list[tuple[str, Callable[[int], list[Any]], int]] = [
        ("llama3-8b", llama, 1024),
        ("llama3-8b", llama, 8192),
    ]
    if not args.quick:
        cases += [("llama3-8b", llama, 32768), ("qwen3-next", qwen3_next, 8192)]
    if args.cases:
        picked = [c.split(":") for c in args.cases]
        cases = [(name, builds[name], int(n)) for name, n in picked]
    label = args.label or device()
    results = []
    for name, build, tokens in cases:
        tmp = Path(tempfile.mkdtemp(dir=Path(__file__).parent))
        try:
            results.append(case(name, build, tokens, tmp, args.reps, args.restore_only))
            print(json.dumps(results[-1]), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    r = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": label},
        "mlx_cache": "as persist serve (freed buffers kept)"
        if args.mlx_cache == "serve"
        else "MLX default (32 MiB on the CPU)",
        "cases": results,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = f"throughput-{label}" + ("-quick" if args.quick else "")
    if args.mlx_cache == "mlx":
        stem += "-mlx-cache"
    if args.cases:
        stem += "-" + "-".join(c.replace(":", "") for c in args.cases)
    if args.restore_only:
        stem += "-restore"
    (RESULTS / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(r))
    print(markdown(r))


def _ratio(s: dict[str, float], a: str, b: str) -> str:
    return f"{s[a] / s[b]:.2f}x" if a in s and b in s else "n/a"


WARM_LIMIT = "limit: read + copy + GPU read (warm)"
COLD_LIMIT = "limit: 8-thread read into pinned (cold)"


def _limit_table(r: dict[str, Any]) -> list[str]:
    """CUDA: the restore against this machine's limits (bench/cuda_limits), same run."""
    cases = [c for c in r["cases"] if WARM_LIMIT in c["seconds"]]
    if not cases:
        return []
    lines = [
        "",
        "Against the machine's limits (8-thread read of the store's files into a pinned "
        "buffer, the copy kernel into device memory, a GPU read of the result):",
        "",
        "| case | restore+step warm | limit warm (read+copy+GPU read) | ratio | "
        "restore+step cold | 8-thread cold read into pinned | ratio | pinned -> device copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        s = c["seconds"]
        lines.append(
            f"| {c['case']} {c['tokens']} ({c['cache_bytes'] / 2**30:.2f} GiB) "
            f"| {s['store restore + step (warm)']:.3f} s | {s[WARM_LIMIT]:.3f} s "
            f"| {_ratio(s, 'store restore + step (warm)', WARM_LIMIT)} "
            f"| {s['store restore + step (cold)']:.3f} s | {s[COLD_LIMIT]:.3f} s "
            f"| {_ratio(s, 'store restore + step (cold)', COLD_LIMIT)} "
            f"| {s['limit: pinned -> device copy']:.3f} s |"
        )
    return lines


def _default_table(r: dict[str, Any]) -> list[str]:
    """The default path's rows (bench/default_path), against the same run's references."""
    cases = [c for c in r["cases"] if default_path.SAVE in c["seconds"]]
    if not cases:
        return []
    save, cold = default_path.SAVE, default_path.RESTORE
    lines = [
        "",
        "Default path: a `persist.Store(root)` opened and closed per operation (the README's "
        "library example), MLX's default buffer cache, in a child process that never changes "
        "it (bench/default_path), timed in the same interleaved rounds:",
        "",
        "| case | save / mlx-lm save+fsync | save / raw write+fsync | "
        "cold restore+step / raw cold read | cold restore+step / raw read into new memory |",
        "|---|---|---|---|---|",
    ]
    for c in cases:
        s = c["seconds"]
        lines.append(
            f"| {c['case']} {c['tokens']} ({c['cache_bytes'] / 2**30:.2f} GiB) "
            f"| {_ratio(s, save, 'mlx-lm save + fsync')} | {_ratio(s, save, 'raw write+fsync')} "
            f"| {_ratio(s, cold, 'raw read (cold)')} "
            f"| {_ratio(s, cold, 'raw read into new memory (cold)')} |"
        )
    return lines


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"# Throughput ({m['device']}, {m['platform']}, {m['cpus']} CPUs)",
        "",
        "Minimum of interleaved repetitions. Ratios: persist over the reference (lower is better).",
        f"MLX buffer cache: {r.get('mlx_cache', 'MLX default')}.",
        "",
        "| case | save / raw write+fsync | save / mlx-lm save+fsync | restore+step warm / mlx-lm | "
        "restore+step cold / raw cold read | cold / raw read of its blob files | "
        "cold / mlx-lm cold | partial bytes | partial time | turn n+1 time | "
        "turn n+1 time, a Store per turn | turn n+1 bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        s, p, t = c["seconds"], c["partial"], c["turn"]
        part = (
            f"{p['hit_bytes'] / p['full_bytes']:.3f}x | {p['hit_s'] / p['full_s']:.3f}x"
            if p
            else "n/a (checkpoints) | n/a"
        )
        if t is None:  # --restore-only: the limits table has it
            continue
        lines.append(
            f"| {c['case']} {c['tokens']} ({c['cache_bytes'] / 2**30:.2f} GiB) "
            f"| {_ratio(s, 'store save', 'raw write+fsync')} "
            f"| {_ratio(s, 'store save', 'mlx-lm save + fsync')} "
            f"| {_ratio(s, 'store restore + step (warm)', 'mlx-lm load + step (warm)')} "
            f"| {_ratio(s, 'store restore + step (cold)', 'raw read (cold)')} "
            f"| {_ratio(s, 'store restore + step (cold)', 'raw read of its blob files (cold)')} "
            f"| {_ratio(s, 'store restore + step (cold)', 'mlx-lm load + step (cold)')} "
            f"| {part} "
            f"| {t['turn_s'] / t['full_s']:.3f}x "
            f"| {t.get('turn_new_store_s', float('nan')) / t['full_s']:.3f}x "
            f"| {t['grew_bytes'] / t['full_bytes']:.3f}x |"
        )
    lines += _default_table(r)
    lines += _limit_table(r)
    lines += [
        "",
        "Cold restores against a cold read into new memory (numpy's, which MLX's buffer "
        "cache does not serve: the cost every load pays without that cache; the plain raw "
        "read reuses one buffer): "
        + ", ".join(
            f"{c['case']} {c['tokens']} "
            + _ratio(c["seconds"], "store restore + step (cold)", "raw read into new memory (cold)")
            for c in r["cases"]
        ),
        "",
        "Seconds:",
        "",
    ]
    for c in r["cases"]:
        lines.append(
            f"- {c['case']} {c['tokens']}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in c["seconds"].items())
        )
        pk = c["peak_above_cache"]
        if pk is None:
            continue
        lines.append(
            f"  peak memory above the cache: save {pk['save'] / 2**20:.0f} MiB, "
            f"restore {pk['restore'] / 2**20:.0f} MiB"
            + (
                f", host memory during a restore {pk['restore_host'] / 2**20:.0f} MiB"
                if "restore_host" in pk
                else ""
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
