"""A fresh process's first restore and save against its later ones, and the device
memory they peak at, on MLX's CUDA backend (issue 39).

    python -m bench.cuda_first_call [--tokens 8192] [--out DIR]

A setup child saves a Llama-3-8B-shaped cache (bench/shapes) into a store; then
each case is a fresh child process, as ``persist generate`` or ``persist serve``
after a restart is: three restores of it (each followed by one decode step; a fourth after
``mx.clear_cache()``, so that it allocates its device memory as the first does),
three saves of fresh caches of the same shape, each timed alone, with MLX's peak
device memory above what was allocated before it.  Cases: restores straight
from the slots (the default) and through a staging buffer (PERSIST_STAGING=whole),
each with no kernel cache (MLX_PTX_CACHE_DIR empty) and after
``engine.staged.restore.prepare`` (what ``persist serve`` runs before it
answers), and after it with calls 2-4 restoring three other sessions of the same size
that the process has not read (a session's blob headers are read once per process,
so restoring "s" again flatters the later calls); saves with no kernel cache and with
MLX's filled by an earlier process.  JSON on
stdout and in OUT/first-call.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHILD = "_child"
OTHERS = 3  # sessions besides "s": calls 2-4 of FIRST_CALL_OTHERS restore them


def _setup(root: str, tokens: int) -> None:
    import mlx.core as mx

    import persist
    from bench.shapes import IDENTITY, llama

    cache = llama(tokens)
    # through the page cache, as persist serve writes (cached_writes): every restore
    # below then reads from memory, the first as the later ones (O_DIRECT writes left
    # only the first to read the disk: a page-cache difference, not a first call's)
    with persist.Store(root, cached_writes=True) as store:
        store.save(cache, list(range(tokens)), identity=IDENTITY, session="s")
        # other sessions of the same size, no blob shared with "s": a later restore of
        # one the process has not read yet (its blob headers unread too)
        for j in range(1, OTHERS + 1):
            other = llama(tokens, seed=j)
            store.save(other, [t + j for t in range(tokens)], identity=IDENTITY, session=f"o{j}")
    mx.synchronize()


def _restores(root: str, prewarm: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    import mlx.core as mx

    import persist
    from bench.shapes import IDENTITY, first_step

    mx.eval(mx.zeros((1,)))
    out: dict[str, Any] = {"init_s": time.perf_counter() - t0}
    if os.environ.get("FIRST_CALL_ROUNDS"):  # the staging's rounds (1: all at once)
        from persist.engine.staged import restore as staging

        staging.ROUNDS = int(os.environ["FIRST_CALL_ROUNDS"])
        out["rounds"] = staging.ROUNDS
    if prewarm:
        from persist.engine.staged.restore import prepare

        t = time.perf_counter()
        out["prepared"] = prepare()
        out["prepare_s"] = time.perf_counter() - t
    from bench.shapes import llama

    tokens = int(os.environ.get("FIRST_CALL_TOKENS", "8192"))
    others = bool(os.environ.get("FIRST_CALL_OTHERS"))  # calls 2-4: sessions not yet read
    want = llama(tokens)  # what setup saved as "s"
    runs = []
    with persist.Store(root) as store:
        if prewarm:  # what persist serve does before it answers
            t = time.perf_counter()
            store.preload()
            store.index.hold_statistics()  # its statistics thread writes rates, not the restore
            out["preload_s"] = time.perf_counter() - t
        for i in range(4):
            gc.collect()
            if i == 3:  # a later restore with MLX's buffer cache emptied: allocation's share
                mx.clear_cache()
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            t = time.perf_counter()
            with _profiled(out, f"profile{i + 1}" if i < 2 else None):
                r = store.restore(f"o{i}" if others and i else "s", identity=IDENTITY)
                mx.synchronize()
            restore_s = time.perf_counter() - t
            peak = mx.get_peak_memory() - base
            cache_bytes = sum(a.nbytes for c in r.cache for a in (c.keys, c.values))
            equal = _same(r.cache, llama(tokens, seed=i) if others and i else want)
            t = time.perf_counter()
            first_step(r.cache)
            mx.synchronize()
            step_s = time.perf_counter() - t
            runs.append(
                {"restore_s": restore_s, "step_s": step_s, "peak_bytes": peak,
                 "cache_bytes": cache_bytes, "peak_ratio": peak / cache_bytes, "equal": equal}
            )  # fmt: skip
            del r
        out["path"] = store.stats().data_paths
    out["runs"] = runs
    return out


@contextlib.contextmanager
def _profiled(out: dict[str, Any], key: str | None) -> Iterator[None]:
    """With FIRST_CALL_PROFILE set, the first and second calls' 30 costliest functions
    (own time) into ``out[key]``: where a first call's extra time goes, by difference."""
    if key is None or not os.environ.get("FIRST_CALL_PROFILE"):
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        out[key] = buf.getvalue()[-6000:]


def _same(got: list[Any], want: list[Any]) -> bool:
    """The restored layers hold the saved keys and values, byte for byte."""
    import mlx.core as mx

    for g, w in zip(got, want, strict=True):
        n = w.offset
        for a, b in ((g.keys, w.keys), (g.values, w.values)):
            x, y = a[..., :n, :].view(mx.uint16), b[..., :n, :].view(mx.uint16)
            if not mx.array_equal(x, y).item():
                return False
    return True


def _saves(root: str, tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    import mlx.core as mx

    import persist
    from bench.shapes import IDENTITY, _kv

    mx.eval(mx.zeros((1,)))
    out: dict[str, Any] = {"init_s": time.perf_counter() - t0}
    runs = []
    with persist.Store(root) as store:
        if os.environ.get("FIRST_CALL_PREPARE"):  # what persist serve does before it answers
            from persist.engine.staged.restore import prepare

            t = time.perf_counter()
            out["prepared"] = prepare()
            store.preload()
            store.index.hold_statistics()  # as persist serve: statistics off the save's path
            out["prepare_s"] = time.perf_counter() - t
        for j in range(3):
            cache = [_kv(tokens, 8, 128, 1000 * (j + 1) + i) for i in range(32)]
            live = sum(a.nbytes for c in cache for a in (c.keys, c.values))
            gc.collect()
            mx.synchronize()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            t = time.perf_counter()
            with _profiled(out, f"profile{j + 1}" if j < 2 else None):
                store.save(cache, list(range(tokens)), identity=IDENTITY, session=f"w{j}")
                mx.synchronize()
            save_s = time.perf_counter() - t
            peak = mx.get_peak_memory() - base
            runs.append({"save_s": save_s, "peak_bytes": peak, "cache_bytes": live,
                         "peak_ratio": peak / live})  # fmt: skip
            del cache
    out["runs"] = runs
    return out


def _child(args: list[str]) -> None:
    what, root = args[0], args[1]
    if what == "setup":
        _setup(root, int(args[2]))
        print("{}")
    elif what == "restore":
        print(json.dumps(_restores(root, args[2] == "1")))
    else:
        print(json.dumps(_saves(root, int(args[2]))))


def _run(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.cuda_first_call", CHILD, *args]
    t = time.perf_counter()
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if got.returncode != 0:
        return {"error": got.stderr[-3000:], "args": args}
    out: dict[str, Any] = json.loads(got.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        _child(sys.argv[2:])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None)
    p.add_argument("--root", default=None, help="where the stores go (default: a temp dir)")
    a = p.parse_args()
    base = Path(a.root or tempfile.mkdtemp(prefix="first-call-"))
    ptx = base / "ptx"
    env = {**os.environ, "MLX_PTX_CACHE_DIR": str(ptx), "FIRST_CALL_TOKENS": str(a.tokens)}
    result: dict[str, Any] = {"tokens": a.tokens}
    result["setup"] = _run(["setup", str(base / "r"), str(a.tokens)], env)
    # the setup child filled the kernel cache; an empty one measures a first process.
    # direct: slots copied straight to the tensors (the default); whole: the staging
    # buffer and the scatter kernel (PERSIST_STAGING=whole)
    for name, prewarm, fresh, staging in (
        ("restore_direct_no_kernel_cache", "0", True, "direct"),
        ("restore_direct_prepared", "1", False, "direct"),
        ("restore_direct_prepared_profiled", "1", False, "direct"),
        ("restore_direct_prepared_other_sessions", "1", False, "direct"),
        ("restore_whole_no_kernel_cache", "0", True, "whole"),
        ("restore_whole_prepared", "1", False, "whole"),
    ):
        e = {**env, "PERSIST_STAGING": staging}
        if name.endswith("_profiled"):
            e["FIRST_CALL_PROFILE"] = "1"
        if name.endswith("_other_sessions"):  # the later calls restore unread sessions
            e["FIRST_CALL_OTHERS"] = "1"
        if fresh:
            e["MLX_PTX_CACHE_DIR"] = str(base / f"ptx-{name}")
        result[name] = _run(["restore", str(base / "r"), prewarm], e)
    result["save_no_kernel_cache"] = _run(
        ["save", str(base / "w1"), str(a.tokens)], {**env, "MLX_PTX_CACHE_DIR": str(base / "p2")}
    )
    result["save_kernel_cache"] = _run(["save", str(base / "w2"), str(a.tokens)], env)
    result["save_prepared"] = _run(
        ["save", str(base / "w3"), str(a.tokens)], {**env, "FIRST_CALL_PREPARE": "1"}
    )
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "first-call.json").write_text(text)


if __name__ == "__main__":
    main()
