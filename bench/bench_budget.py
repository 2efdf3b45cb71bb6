"""The cost of a save at the byte budget, against the number of blocks in the store.

    python -m bench.bench_budget            # 32,000 blocks; results in bench/results/budget.*

Round 1 scanned every snapshot_blocks row inside the write lock on every
save with ``max_bytes`` set (82 ms at 32,000 blocks).  Live bytes are now
kept by triggers and eviction takes one victim at a time, so a save at the
budget costs about what a save without one does.  Minimum of interleaved
repetitions of the same save (16-token blocks keep the data small).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from mlx_lm.models import cache as mc

import persist
from bench.common import machine, write_results
from tests.golden.cases import IDENTITY, kvs

BLOCK, TOKENS = 16, 1600  # 100 blocks a session


def kv(seed: int) -> mc.KVCache:
    c = mc.KVCache()
    c.update_and_fetch(*kvs(seed, TOKENS))
    return c


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "s"
        with persist.Store(root, block_tokens=BLOCK) as s:
            for i in range(320):
                s.save([kv(i)], [i] * TOKENS, identity=IDENTITY, session=f"s{i}")
            blocks = s.index.db.execute("SELECT COUNT(*) FROM snapshot_blocks").fetchone()[0]
            total = s.stats().unique_bytes
        probe = kv(10_000)
        best = {"no budget": float("inf"), "at the budget (evicts one)": float("inf")}
        for r in range(5):
            for name, budget in (("no budget", None), ("at the budget (evicts one)", total)):
                with persist.Store(root, max_bytes=budget) as s:
                    t0 = time.perf_counter()
                    s.save([probe], [7 + r] * TOKENS, identity=IDENTITY, session=f"p{r}-{name}")
                    best[name] = min(best[name], time.perf_counter() - t0)
    ratio = best["at the budget (evicts one)"] / best["no budget"]
    md = "\n".join(
        [
            "# A save at the byte budget",
            "",
            f"`python -m bench.bench_budget` on {machine()['platform']}: a store of "
            f"{blocks:,} blocks ({TOKENS // BLOCK} per session), one more {TOKENS}-token save, "
            "minimum of 5 interleaved repetitions.",
            "",
            "| save | ms |",
            "|---|---|",
            *(f"| {k} | {1e3 * v:.1f} |" for k, v in best.items()),
            "",
            f"Ratio at the budget / without: {ratio:.2f}x "
            "(round 1: an extra 82 ms scan at 32,000 blocks).",
            "",
        ]
    )
    write_results("budget", {"blocks": blocks, "ms": {k: 1e3 * v for k, v in best.items()},
                             "machine": machine()}, md)  # fmt: skip
    print(md)


if __name__ == "__main__":
    main()
