"""Does saving a long cache slow the decode steps that follow it (MLX's CUDA backend)?

Prefill n tokens into a random-weight Llama-3-8B-shaped model, time decode steps,
save the cache into a store, time again; then after a garbage collection, after a
restore (steps on the restored cache), and after saving from a copy of the cache.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import persist
from bench.bench_recompute import IDENTITY, LLAMA3_8B, build, prefill, step


def steps(model: object, cache: list[object], label: str) -> None:
    times = [step(model, cache) for _ in range(4)]
    print(f"{label}: " + ", ".join(f"{t * 1e3:.1f}" for t in times) + " ms", flush=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    model = build(LLAMA3_8B)
    tokens = mx.random.randint(0, 32000, (n,))
    cache, secs = prefill(model, tokens)
    print(f"prefill {n}: {secs:.2f} s", flush=True)
    steps(model, cache, "before the save")
    if "--phase" in sys.argv:  # persist's own path, in two processes: save, then restore
        phase, root = sys.argv[sys.argv.index("--phase") + 1], Path(sys.argv[-1])
        with persist.Store(root) as store:
            if phase == "save":
                toks = [*tokens.tolist(), *[7] * 4]
                t = time.perf_counter()
                store.save(cache, toks, identity=IDENTITY, session="s")
                print(f"save {time.perf_counter() - t:.2f} s", flush=True)
                steps(model, cache, "after persist's save")
            else:
                t = time.perf_counter()
                restored = store.restore("s", identity=IDENTITY).cache
                print(f"restore {time.perf_counter() - t:.2f} s", flush=True)
                steps(model, restored, "the restored cache")
                steps(model, cache, "a prefilled cache, after the restore")
        return
    if "--copy-first" in sys.argv:  # save from a device copy; keep decoding the original
        copied = [type(c)() for c in cache]
        for c, o in zip(copied, cache, strict=True):
            c.keys, c.values, c.offset = o.keys + 0, o.values + 0, o.offset
        mx.eval([(c.keys, c.values) for c in copied])
        toks = [*tokens.tolist(), *[7] * 4]
        with persist.Store(Path(tempfile.mkdtemp()) / "s") as store:
            store.save(copied, toks, identity=IDENTITY, session="s")
        del copied
        gc.collect()
        steps(model, cache, "the original, after a save of its copy")
        return
    if "--mlx-lm-first" in sys.argv:  # mlx-lm's own writer: does it do the same?
        from mlx_lm.models.cache import save_prompt_cache

        t = time.perf_counter()
        save_prompt_cache(str(Path(tempfile.mkdtemp()) / "m.safetensors"), cache)
        print(f"mlx-lm save_prompt_cache {time.perf_counter() - t:.2f} s", flush=True)
        steps(model, cache, "after mlx-lm's save")
        toks = [*tokens.tolist(), *[7] * 8]
        with persist.Store(Path(tempfile.mkdtemp()) / "s") as store:
            store.save(cache, toks, identity=IDENTITY, session="s")
            steps(model, cache, "after persist's save")
        return
    toks = [*tokens.tolist(), *[7] * 4]
    with persist.Store(Path(tempfile.mkdtemp()) / "s") as store:
        t = time.perf_counter()
        store.save(cache, toks, identity=IDENTITY, session="s")
        print(f"save {time.perf_counter() - t:.2f} s", flush=True)
        steps(model, cache, "after the save")
        gc.collect()
        steps(model, cache, "after gc")
        toks += [7] * 8  # the steps above
        restored = store.restore("s", identity=IDENTITY).cache
        steps(model, restored, "restored cache")
        del restored
        copied = [type(c)() for c in cache]
        for c, o in zip(copied, cache, strict=True):
            c.keys, c.values, c.offset = o.keys + 0, o.values + 0, o.offset
        mx.eval([(c.keys, c.values) for c in copied])
        steps(model, copied, "a copy, before its save")
        extra = copied[0].offset - len(toks)  # the steps fed token 7
        store.save(copied, [*toks, *[7] * extra], identity=IDENTITY, session="c")
        steps(model, copied, "the copy, after its save")


if __name__ == "__main__":
    main()
