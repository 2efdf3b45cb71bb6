"""An evicted conversation's next turn: from the host tier, from the store, or recomputed.

mlx-lm's in-memory prompt cache holds one conversation (``--prompt-cache-size
1``); conversation A, then B (which evicts A), then A's next turn, timed
(``max_tokens=1``: about the time to first token).  Three servers, one run,
minimum over repetitions after a warm-up (fresh conversations each time):
``persist serve`` with its host tier (pinned host memory on CUDA), the same
with ``--host-cache 0`` (A comes back from the store's files), and plain
``mlx_lm.server`` (A is prefilled again).  /metrics says where each hit came from.

    python -m bench.bench_serve_host [--words 820] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.common import SMALL_LLAMA, machine, write_results
from bench.servers import Server
from persist.apps.demo import make_model

Messages = list[dict[str, str]]


def conversation(words: int, seed: int) -> tuple[Messages, Messages]:
    system = " ".join(f"fact{(i * 7 + seed) % 97} is {i + seed}." for i in range(words // 3))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    return first, [
        *first,
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "And the next?"},
    ]


def scrape(server: Server) -> list[str]:
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read().decode().splitlines()


def hits(lines: list[str]) -> dict[str, float]:
    """Hits by source, from /metrics (persist serve only)."""
    out: dict[str, float] = {}
    for line in lines:
        if line.startswith('persist_cache_lookups_total{result="hit"'):
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def steps(lines: list[str]) -> dict[str, list[float]]:
    """Per step persist adds to the generation thread: [calls, seconds] over the run."""
    out: dict[str, list[float]] = {}
    for line in lines:
        for part, i in (("_count{", 0), ("_sum{", 1)):
            if line.startswith("persist_generation_thread_seconds" + part):
                step = line.split('step="')[1].split('"')[0]
                out.setdefault(step, [0.0, 0.0])[i] = float(line.rsplit(" ", 1)[1])
    return out


def evicted_turn(server: Server, words: int, reps: int) -> tuple[float, int, int]:
    """(best seconds of A's next turn, its prompt tokens, its cached tokens)."""
    best, prompt, cached = float("inf"), 0, 0
    for rep in range(reps + 1):  # rep 0 warms up: the first run of a shape compiles
        a1, a2 = conversation(words, 2 * rep)
        b1, _ = conversation(words, 2 * rep + 1)
        server.chat(a1, max_tokens=1)
        server.chat(b1, max_tokens=1)  # A leaves mlx-lm's cache
        t0 = time.perf_counter()
        resp = server.chat(a2, max_tokens=1)
        dt = time.perf_counter() - t0
        if rep and dt < best:
            usage = resp["usage"]
            best, prompt = dt, usage["prompt_tokens"]
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return best, prompt, cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--words", type=int, default=820)  # about 4k tokens
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="serve-host")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        model = make_model(tmp / "model", "llama", overrides=SMALL_LLAMA)
        persist = ["persist", "serve", "--model", str(model), "--prompt-cache-size", "1"]
        configs = [
            ("persist serve, host tier", [*persist, "--store", str(tmp / "a")]),
            (
                "persist serve, store only",
                [*persist, "--store", str(tmp / "b"), "--host-cache", "0"],
            ),
            ("mlx_lm.server", ["mlx_lm.server", "--model", str(model), "--prompt-cache-size", "1"]),
        ]
        for name, argv in configs:
            server = Server(argv, tmp / f"{len(rows)}.log")
            try:
                seconds, prompt, cached = evicted_turn(server, args.words, args.reps)
                lines = scrape(server) if argv[0] == "persist" else []
                where, spent = hits(lines), steps(lines)
                health = {}
                if argv[0] == "persist":
                    url = f"http://127.0.0.1:{server.port}/health"
                    with urllib.request.urlopen(url, timeout=60) as r:
                        health = json.loads(r.read()).get("host_cache", {})
            finally:
                server.stop()
            rows.append(
                {
                    "config": name,
                    "seconds": seconds,
                    "prompt_tokens": prompt,
                    "cached_tokens": cached,
                    "hits": where,
                    "generation_thread": spent,
                    "host_cache": health,
                }
            )
    base = rows[-1]["seconds"]
    lines = [
        "# An evicted conversation's next turn (time to first token)\n",
        f"{machine()}; a llama-shaped model (random weights), `--prompt-cache-size 1`, "
        f"minimum of {args.reps} after a warm-up.\n",
        "| server | seconds | vs recompute | prompt / cached tokens | hits by source |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['seconds']:.3f} | {r['seconds'] / base:.2f}x | "
            f"{r['prompt_tokens']} / {r['cached_tokens']} | {r['hits'] or '-'} |"
        )
    lines.append(
        "\nWhat persist added on the generation thread over the whole run (warm-up "
        f"included, {3 * (args.reps + 1)} requests), per step: calls, mean ms per call.\n"
    )
    for r in rows[:-1]:
        spent = r["generation_thread"].items()
        told = ", ".join(f"{k} {int(n)} x {1000 * t / max(n, 1):.1f} ms" for k, (n, t) in spent)
        lines.append(f"- {r['config']}: {told or '-'}")
    host = rows[0]["host_cache"]
    if host:
        lines.append(f"\nThe host tier: {host.get('where')}, {host}.")
    md = "\n".join(lines) + "\n"
    write_results(args.name, {"machine": machine(), "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
