"""Print the benchmarks page (docs/benchmarks.md) from bench/results/*.json.

python -m bench.report > /tmp/section.md    # then paste it over the start of docs/benchmarks.md
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
GB = 1e9


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / f"{name}.json").read_text()))


def files_section(r: dict[str, Any]) -> list[str]:
    out = [
        "| cache | op | persist | mlx-lm | raw limit | persist / raw | mlx-lm / persist |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        gb, raw = row["bytes_ours"] / GB, row["raw"]
        for op, ours, theirs, limit, lname in (
            ("save", row["save_file"], row["mlx_lm_save"], raw["write+fsync"], "write+fsync"),
            (
                "load warm",
                row["load_file_warm"],
                row["mlx_lm_load_warm"],
                raw["warm read into MLX (mx.load)"],
                "mx.load warm",
            ),
            (
                "load cold",
                row["load_file_cold"],
                row["mlx_lm_load_cold"],
                raw["cold read"],
                "cold read",
            ),
        ):
            out.append(
                f"| {row['shape']} {row['tokens']} tok | {op} | {ours:.3f} s "
                f"({gb / ours:.2f} GB/s) | {theirs:.3f} s | {lname} {limit:.3f} s | "
                f"{ours / limit:.2f}x | {theirs / ours:.2f}x |"
            )
    out += [
        "",
        "| cache | persist bytes | mlx-lm bytes | save: peak above cache "
        "(largest tensor) | load: peak above start (restored cache) |",
        "|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        ms, ml = row["memory"]["save"], row["memory"]["load"]
        out.append(
            f"| {row['shape']} {row['tokens']} tok | {row['bytes_ours'] / 2**20:.1f} MiB | "
            f"{row['bytes_mlx_lm'] / 2**20:.1f} MiB | {ms['peak_above_bytes'] / 2**20:.1f} "
            f"MiB ({ms['largest_tensor'] / 2**20:.1f} MiB) | "
            f"{ml['peak_above_bytes'] / 2**20:.1f} MiB ({ml['restored_bytes'] / 2**20:.1f} "
            "MiB) |"
        )
    return out


def store_section(r: dict[str, Any]) -> list[str]:
    s = r["speed"][0]
    gb = s["file_bytes"] / GB
    out = [
        f"The store with a Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, "
        f"bf16) of {s['tokens']:,} tokens, beside save_file/load_file, mlx-lm and the raw "
        "limits, in one interleaved run:",
        "",
        "| operation | seconds | GB/s |",
        "|---|---|---|",
    ]
    out += [f"| {k} | {v:.3f} | {gb / v:.2f} |" for k, v in s["seconds"].items()]
    t, lk, tt = r["turn"], r["lookup"], r["ttft"]
    out += [
        "",
        f"- Incremental save: turn n+1 ({t['new_tokens']} new tokens) of a {t['tokens']:,}-token "
        f"conversation takes {t['incremental_s']:.3f} s and writes "
        f"{t['incremental_bytes'] / 2**20:.0f} MiB; a full rewrite takes "
        f"{t['full_rewrite_s']:.3f} s and {t['full_bytes'] / 2**20:.0f} MiB "
        f"({t['incremental_s'] / t['full_rewrite_s']:.2f}x the time, "
        f"{t['incremental_bytes'] / t['full_bytes']:.3f}x the bytes).",
        f"- Lookup with {lk['snapshots']:,} snapshots in the index: median "
        f"{lk['hit_median_ms']:.2f} ms for a prompt with a stored prefix (p95 "
        f"{lk['hit_p95_ms']:.2f} ms), {lk['miss_median_ms']:.2f} ms for a miss.",
        f"- Time to first token, {tt['params'] / 1e6:.0f}M-parameter llama-shaped model, "
        f"{tt['tokens']:,}-token session: recomputing the prefill {tt['recompute_s']:.1f} s; "
        f"restoring it from the store (cold page cache) and decoding {tt['restore_cold_s']:.3f} s: "
        f"**{tt['speedup']:.0f}x**, the same first token.",
    ]
    return out


def serve_section(r: dict[str, Any]) -> list[str]:
    return [
        f"- Server restart: the second request of a {r['prompt_tokens']:,}-token conversation "
        f"after a restart takes {r['without_persist_s']:.1f} s on a plain mlx_lm.server and "
        f"{r['with_persist_s']:.2f} s on `persist serve` ({r['cached_tokens']:,} prompt tokens "
        f"from the store): **{r['speedup']:.0f}x**; same first token: {r['same_token']}."
    ]


def included(name: str) -> list[str]:
    """A result's own markdown, less its title: it already says how it was measured."""
    lines = (RESULTS / f"{name}.md").read_text().splitlines()
    return [*lines[2:], ""] if lines and lines[0].startswith("# ") else [*lines, ""]


def main() -> None:
    serve = load("serve")
    m = load("throughput-cpu")["machine"]
    lines = [
        "# Benchmarks",
        "",
        f"Measured on this project's CI machine ({m['cpus']} CPUs, 24 GiB, a VM whose fresh "
        "memory and page cache are slow) and on an NVIDIA H200 through MLX's CUDA backend; "
        "minimum of interleaved runs after a warm-up round. Reproduce with "
        "`python -m bench.bench_throughput`, `bench.bench_recompute`, `bench.bench_identity`, "
        "`bench.bench_lookup`, `bench.bench_budget`, `bench.bench_serve` and "
        "`bench.bench_serve_load` (results in `bench/results/`, this section from "
        "`python -m bench.report`).",
        "",
        "Save and restore against mlx-lm and the machine's raw limits, this machine "
        "(persist fsyncs and verifies every checksum; mlx-lm does neither):",
        "",
        *included("throughput-cpu"),
        *(
            [
                "The same with MLX's own CPU buffer cache (32 MiB: every load faults in "
                "fresh memory, which this VM makes slow):",
                "",
                *included("throughput-cpu-quick-mlx-cache"),
            ]
            if (RESULTS / "throughput-cpu-quick-mlx-cache.md").exists()
            else []
        ),
        "The same on the NVIDIA H200:",
        "",
        *included("throughput-cuda-llama3-8b1024-llama3-8b8192-qwen3-next8192"),
        "The latest H200 run, 8,192 tokens, with reader processes filling the staging "
        "lanes (bench/results/cuda-restore-r5.md: the probe beside it measured reader "
        "processes at 0.110 s against threads at 0.140 s; the save of this build read its "
        "copies back by pageable driver copies, since replaced by copies through the "
        "lanes):",
        "",
        *included("throughput-cuda-llama3-8b8192"),
        "32,768 tokens on the H200, from a build before the staged restore (the host "
        "path; the staged path's runs of it with the limit rows did not fit in the device "
        "time: its restores are in the probe and recompute results):",
        "",
        *included("throughput-cuda-llama3-8b32768"),
        "Restore or recompute on the H200 (a random-weight Llama-3-8B, bf16, the staged "
        "restore), latest run: the cost model tells a hit in the page cache from one on "
        "the disk (mincore on a sample of its blobs) and keeps a rate for each; it "
        "restores warm hits from 2,048 tokens (1.6x faster than the prefill at 8,192) "
        "and recomputes when the blobs are on this machine's disk (1.5 GB/s). The decode "
        "step after a restore is as fast as after a prefill (no managed memory in the "
        "cache):",
        "",
        *included("recompute-cuda-r5"),
        "An earlier run up to 32,768 tokens (its cost model averaged warm and cold "
        "restores into one rate, and declined every hit):",
        "",
        *included("recompute-cuda"),
        "`persist serve` on the H200 with mlx-lm's prompt cache holding one "
        "conversation: the next turn of an evicted one, from the host tier's pinned "
        "memory, from the store, or recomputed (a 24M-parameter model, whose prefill of "
        "4k tokens is cheaper than any restore; bench/bench_serve_host.py):",
        "",
        *included("serve-host-cuda"),
        "The same for a Qwen3-Next-shaped hybrid (48 layers, 36 of them gated-DeltaNet; 16 "
        "experts instead of 512, 10 active as there). mlx-lm's gated-delta kernel is Metal "
        "only, so on CUDA its prefill runs the reference ops and restoring wins by 77-122x; "
        "the cost model restores:",
        "",
        *included("recompute-cuda-qwen3-next"),
        *included("identity"),
        *serve_section(serve),
        "",
        "Lookups against the number of sessions that share a prompt's prefix:",
        "",
        *included("lookup"),
        "A save at the byte budget:",
        "",
        *included("budget"),
        *(
            [
                "A server's lifetime: one store grown to 100,000 sessions:",
                "",
                *included("scale-full"),
            ]
            if (RESULTS / "scale-full.md").exists()
            else []
        ),
        "`persist serve` under load, beside plain `mlx_lm.server` (plain's errors are",
        "connection resets from its backlog of 5 during the burst; its exit code is",
        "-15 because SIGTERM kills it):",
        "",
        *included("serve-load"),
        "",
        "`persist serve` against plain `mlx_lm.server` end to end, side by side in one",
        "run (`python -m bench.bench_e2e`; the CPU run of record was taken while the",
        "2-core VM also ran a test suite: compare the servers, not the seconds):",
        "",
        *(included("e2e-cpu") if (RESULTS / "e2e-cpu.md").exists() else []),
        "The same on an NVIDIA GPU (`bench/cuda_restore_run.sh e2efull`: Llama-3-8B",
        "shape, bf16, an ~7k-token system prompt):",
        "",
        *(included("e2e-cuda") if (RESULTS / "e2e-cuda.md").exists() else []),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
