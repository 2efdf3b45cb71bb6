"""Restore or recompute: prefill time beside restore time, on a real model, one run.

    python -m bench.bench_recompute                  # Llama-3-8B shape, 8k and 32k tokens
    python -m bench.bench_recompute --lengths 8192 32768 131072
    python -m bench.bench_recompute --shape small    # a 24M-parameter llama (CPU smoke run)

A random-weight model of the Llama-3-8B shape (bf16) prefills n tokens (after
a warm-up run of that length, which compiles kernels); the cache is saved into
a store and restored, and the first decode step runs on it, with the page cache
warm and cold.  Also the decode-step time on a cache before and after a save
(saving reads the cache on the host; it must not slow later steps).  Results
in bench/results/recompute-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import persist
from bench.common import RESULTS, SMALL_LLAMA, evict

LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
}
IDENTITY = persist.ModelIdentity("bench", "c", "w", "t", "h", name="bench")
CHUNK = 2048


def build(shape: dict[str, int]) -> Any:
    args = llama.ModelArgs(
        model_type="llama",
        vocab_size=32000,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **shape,
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def prefill(model: Any, tokens: mx.array) -> tuple[list[Any], float]:
    cache = make_prompt_cache(model)
    mx.synchronize()
    t = time.perf_counter()
    for i in range(0, tokens.size, CHUNK):
        logits = model(tokens[None, i : i + CHUNK], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    mx.synchronize()
    return cache, time.perf_counter() - t


def step(model: Any, cache: list[Any]) -> float:
    mx.synchronize()
    t = time.perf_counter()
    logits = model(mx.array([[7]]), cache=cache)
    mx.eval(logits)
    mx.synchronize()
    return time.perf_counter() - t


def one(model: Any, n: int, tmp: Path) -> dict[str, Any]:
    tokens = mx.random.randint(0, 32000, (n,))
    prefill(model, tokens)  # warm-up: kernels for this shape
    cache, first = prefill(model, tokens)
    _, again = prefill(model, tokens)
    before = min(step(model, cache) for _ in range(5))
    toks = [*tokens.tolist(), *[7] * 5]  # step() feeds token 7
    with persist.Store(tmp / "store") as store:
        t = time.perf_counter()
        store.save(cache, toks, identity=IDENTITY, session="s")
        save_s = time.perf_counter() - t
        after = min(step(model, cache) for _ in range(5))
        files = list((tmp / "store" / "blobs").rglob("*.safetensors"))
        out: dict[str, Any] = {}
        for mode in ("warm", "cold", "warm", "cold"):
            if mode == "cold":
                for p in files:
                    evict(p)
            gc.collect()
            t = time.perf_counter()
            restored = store.restore("s", identity=IDENTITY).cache
            step(model, restored)
            dt = time.perf_counter() - t
            out[mode] = min(out.get(mode, float("inf")), dt)
            del restored
        nbytes = store.stats().unique_bytes
    prefill_s = min(first, again)
    return {
        "tokens": n,
        "cache_bytes": nbytes,
        "prefill_s": prefill_s,
        "save_s": save_s,
        "restore_step_warm_s": out["warm"],
        "restore_step_cold_s": out["cold"],
        "decode_step_before_save_s": before,
        "decode_step_after_save_s": after,
        "restore_wins": out["cold"] < prefill_s,
    }


def device() -> str:
    d = mx.default_device()
    if d.type == mx.gpu and mx.cuda.is_available():
        return "cuda"
    return "metal" if d.type == mx.gpu else "cpu"


def device_name(label: str) -> str:
    if label == "cuda":
        import subprocess

        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            return out.stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "NVIDIA GPU"
    return platform.processor() or platform.machine()


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"# Restore or recompute ({m['device']}: {m['device_name']}, {m['shape']} shape, bf16)",
        "",
        "| tokens | cache | prefill | restore + step (warm) | restore + step (cold) | "
        "prefill / cold restore | decode step before / after a save |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["cases"]:
        lines.append(
            f"| {c['tokens']} | {c['cache_bytes'] / 2**30:.2f} GiB | {c['prefill_s']:.3f} s "
            f"| {c['restore_step_warm_s']:.3f} s | {c['restore_step_cold_s']:.3f} s "
            f"| {c['prefill_s'] / c['restore_step_cold_s']:.2f}x "
            f"| {c['decode_step_before_save_s'] * 1e3:.1f} / "
            f"{c['decode_step_after_save_s'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--shape", choices=["llama3-8b", "small"], default="llama3-8b")
    args = ap.parse_args()
    shape = LLAMA3_8B if args.shape == "llama3-8b" else SMALL_LLAMA
    model = build(shape)
    label = device()
    name = device_name(label)
    cases = []
    for n in args.lengths:
        tmp = Path(
            tempfile.mkdtemp(dir=os.environ.get("PERSIST_BENCH_TMP") or Path(__file__).parent)
        )
        try:
            cases.append(one(model, n, tmp))
            print(json.dumps(cases[-1]), flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    r = {
        "machine": {
            "platform": platform.platform(),
            "device": label,
            "device_name": str(name),
            "shape": args.shape,
        },
        "cases": cases,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = f"recompute-{label}" + ("" if args.shape == "llama3-8b" else f"-{args.shape}")
    (RESULTS / f"{stem}.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
