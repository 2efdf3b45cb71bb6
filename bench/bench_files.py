"""save_file/load_file against mlx-lm's save/load_prompt_cache and the raw limits.

Everything is measured side by side in one run, on the same cache, and
written to bench/results/files.{json,md}.  Memory is measured in a child
process per operation: the peak resident bytes above the cache itself.

    python -m bench.bench_files            # Llama-3-8B shape at 1k and 8k tokens, Qwen-0.5B shape
    python -m bench.bench_files --quick    # small sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import persist
from bench.common import (
    evict,
    interleaved,
    kv_cache,
    live_bytes,
    machine,
    peak_above,
    raw_ops,
    warm,
    write_results,
)

GB = 1e9


def bench_case(shape: str, tokens: int, tmp: Path, reps: int) -> dict[str, Any]:
    cache = kv_cache(shape, tokens)
    toks = list(range(tokens))
    ours, theirs = tmp / "ours.safetensors", tmp / "theirs.safetensors"
    persist.save_file(ours, cache, toks)
    save_prompt_cache(str(theirs), cache)
    row: dict[str, Any] = {
        "shape": shape,
        "tokens": tokens,
        "live_bytes": live_bytes(cache),
        "bytes_ours": ours.stat().st_size,
        "bytes_mlx_lm": theirs.stat().st_size,
    }

    def load_ours() -> None:
        mx.eval([c.state for c in persist.load_file(ours).cache])

    def load_theirs() -> None:
        mx.eval([c.state for c in load_prompt_cache(str(theirs))])

    ops = {
        "save_file": (None, lambda: persist.save_file(ours, cache, toks)),
        "mlx_lm_save": (None, lambda: save_prompt_cache(str(theirs), cache)),
        "load_file_warm": (lambda: warm(ours), load_ours),
        "mlx_lm_load_warm": (lambda: warm(theirs), load_theirs),
        "load_file_cold": (lambda: evict(ours), load_ours),
        "mlx_lm_load_cold": (lambda: evict(theirs), load_theirs),
        **{f"raw {k}": v for k, v in raw_ops(row["bytes_ours"], tmp).items()},
    }
    timed = interleaved(ops, reps)
    row |= {k: v for k, v in timed.items() if not k.startswith("raw ")}
    row["raw"] = {k[4:]: v for k, v in timed.items() if k.startswith("raw ")}
    row["memory"] = {op: child_memory(shape, tokens, op, tmp) for op in ("save", "load")}
    return row


def child_memory(shape: str, tokens: int, op: str, tmp: Path) -> dict[str, int]:
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_files",
        "--memory",
        op,
        "--shape",
        shape,
        "--tokens",
        str(tokens),
        "--tmp",
        str(tmp),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def memory_probe(op: str, shape: str, tokens: int, tmp: Path) -> dict[str, int]:
    path = tmp / "mem.safetensors"
    if op == "save":
        cache = kv_cache(shape, tokens)
        largest = max(c.keys[..., : c.offset, :].nbytes for c in cache)
        with peak_above() as m:
            persist.save_file(path, cache, list(range(tokens)))
        return {**m, "largest_tensor": largest, "cache_bytes": live_bytes(cache)}
    loaded = persist.load_file(path)  # warm the page cache and the imports
    largest = max(c.keys[..., : c.offset, :].nbytes for c in loaded.cache)
    restored = sum(c.keys.nbytes + c.values.nbytes for c in loaded.cache)
    del loaded
    gc.collect()
    mx.clear_cache()
    with peak_above() as m:
        persist.load_file(path)
    return {**m, "largest_tensor": largest, "restored_bytes": restored}


def markdown(rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        "# save_file / load_file benchmark",
        "",
        f"Machine: {info['platform']}, {info['cpus']} CPUs, MLX {info['mlx']}. "
        "Median of 3 interleaved runs after a warm-up round; "
        "warm = file in the page cache, cold = evicted first. "
        "persist verifies every tensor's checksum on load and fsyncs on save; "
        "mlx-lm does neither. GB/s are over the bytes persist writes.",
        "",
        "| cache | op | persist | mlx-lm | raw limit | persist / raw | mlx-lm / persist |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"{r['shape']} {r['tokens']} tok"
        gb = r["bytes_ours"] / GB
        raw = r["raw"]
        for op, ours, theirs, limit in (
            ("save", r["save_file"], r["mlx_lm_save"], raw["write+fsync"]),
            (
                "load warm",
                r["load_file_warm"],
                r["mlx_lm_load_warm"],
                raw["warm read into MLX (mx.load)"],
            ),
            ("load cold", r["load_file_cold"], r["mlx_lm_load_cold"], raw["cold read"]),
        ):
            lines.append(
                f"| {name} | {op} | {ours:.3f} s ({gb / ours:.2f} GB/s) | {theirs:.3f} s | "
                f"{limit:.3f} s ({gb / limit:.2f} GB/s) | {ours / limit:.2f}x "
                f"| {theirs / ours:.2f}x |"
            )
    lines += [
        "",
        "| cache | persist bytes | mlx-lm bytes | save peak above cache | "
        "largest tensor | load peak above start | restored cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, ml = r["memory"]["save"], r["memory"]["load"]
        lines.append(
            f"| {r['shape']} {r['tokens']} tok | {r['bytes_ours'] / 2**20:.1f} MiB | "
            f"{r['bytes_mlx_lm'] / 2**20:.1f} MiB | {ms['peak_above_bytes'] / 2**20:.1f} MiB | "
            f"{ms['largest_tensor'] / 2**20:.1f} MiB | {ml['peak_above_bytes'] / 2**20:.1f} MiB | "
            f"{ml['restored_bytes'] / 2**20:.1f} MiB |"
        )
    lines += ["", "Raw limits on the same byte count (seconds):", ""]
    for r in rows:
        lines.append(
            f"- {r['shape']} {r['tokens']} tok: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["raw"].items())
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--memory", choices=["save", "load"])
    ap.add_argument("--shape")
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--tmp", type=Path)
    args = ap.parse_args()
    if args.memory:
        print(json.dumps(memory_probe(args.memory, args.shape, args.tokens, args.tmp)))
        return
    cases = (
        [("qwen2.5-0.5b", 1000)]
        if args.quick
        else [("llama3-8b", 1000), ("llama3-8b", 8000), ("qwen2.5-0.5b", 8000)]
    )
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        for shape, tokens in cases:
            rows.append(bench_case(shape, tokens, Path(d), reps=3))
            print(json.dumps(rows[-1]), flush=True)
    info = machine()
    name = "files-quick" if args.quick else "files"
    write_results(name, {"machine": info, "rows": rows}, markdown(rows, info))
    print(markdown(rows, info))


if __name__ == "__main__":
    main()
