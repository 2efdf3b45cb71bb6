"""Lookup cost against the number of sessions that share a prompt's prefix.

    python -m bench.bench_lookup            # 20, 200 and 2,000 chats; results in bench/results/
    python -m bench.bench_lookup --quick

Chats share a 1,024-token system prompt (four full blocks) and go on with
their own turns, as a server's conversations do.  Three prompts are timed,
interleaved, minimum of the repetitions: a new chat (hits the system
prompt), a chat continuing an old conversation (hits its own session), and
a prompt 16 tokens into a block after the system prompt.  Round 1's lookup
compared every candidate sharing the deepest block: 35, 119 and 435 ms at
250, 1,000 and 3,000 sessions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from mlx_lm.models import cache as mc

import persist
from bench.common import machine, write_results
from tests.golden.cases import IDENTITY, kvs

SYSTEM = list(range(1000, 2024))


def chat(i: int) -> list[int]:
    return SYSTEM + [(i * 7919 + k * 31) % 50_000 for k in range(200)]


def build(root: Path, n: int) -> persist.Store:
    store = persist.Store(root)
    c = mc.KVCache()
    c.update_and_fetch(*kvs(1, len(chat(0))))
    for i in range(n):
        store.save([c], chat(i), identity=IDENTITY, session=f"chat{i}")
    return store


def timed(store: persist.Store, prompt: list[int], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        found = store.find(prompt, identity=IDENTITY)
        best = min(best, time.perf_counter() - t0)
        assert found is not None
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    sizes = [20, 200] if args.quick else [20, 200, 2000]
    reps = 5 if args.quick else 30
    prompts = {
        "new chat": SYSTEM + [7, 8, 9],
        "old chat continued": chat(3)[:1150] + [1],
        "16 into the next block": chat(5)[: 1024 + 16] + [2],
    }
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as d:
        stores = {n: build(Path(d) / str(n), n) for n in sizes}
        for name, prompt in prompts.items():
            got: dict[int, float] = {n: float("inf") for n in sizes}
            for _ in range(3):  # interleaved rounds
                for n in sizes:
                    got[n] = min(got[n], timed(stores[n], prompt, reps))
            rows[name] = {str(n): 1e3 * t for n, t in got.items()}
        for s in stores.values():
            s.close()
    big, small = str(sizes[-1]), str(sizes[0])
    lines = [
        "# Lookup cost against sessions sharing a prefix",
        "",
        f"`python -m bench.bench_lookup{' --quick' if args.quick else ''}` on "
        f"{machine()['platform']}; ms, minimum of {reps} x 3 interleaved `find` calls.",
        "",
        "| prompt | " + " | ".join(f"{n} chats" for n in sizes) + f" | {big} / {small} |",
        "|---|" + "---|" * (len(sizes) + 1),
    ]
    for name, r in rows.items():
        ratio = r[big] / r[small]
        lines.append(
            f"| {name} | " + " | ".join(f"{r[str(n)]:.2f}" for n in sizes) + f" | {ratio:.2f}x |"
        )
    md = "\n".join(lines) + "\n"
    data: dict[str, Any] = {"ms": rows, "machine": machine()}
    write_results("lookup-quick" if args.quick else "lookup", data, md)
    print(md)


if __name__ == "__main__":
    main()
