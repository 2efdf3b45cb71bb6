"""The shared Redis tier over loopback, one run: an 8k Llama-3-8B-shaped session restored
from Redis on an empty machine, beside the local store and the raw read; the lookup of a
32k-token prompt (round trips, ms); save throughput with write-through on and off.

    python -m bench.bench_shared            # starts its own redis-server on 127.0.0.1

Results in bench/results/shared.json and .md.  Minimum of interleaved runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import persist
from bench.bench_throughput import IDENTITY, llama
from bench.common import RESULTS, machine, raw_read, warm
from tests.tiers.conftest import RedisServer

REPS = 3
GB = 1e9


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    tmp = Path(tempfile.mkdtemp(dir=Path(__file__).parent))
    server = RedisServer(tmp, "--maxmemory", "6gb", "--maxmemory-policy", "allkeys-lru")
    server.start()
    try:
        r = run(tmp, server.url)
        r["redis"] = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    r["machine"] = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shared.json").write_text(json.dumps(r, indent=2) + "\n")
    md = markdown(r)
    (RESULTS / "shared.md").write_text(md)
    print(md)


def run(tmp: Path, url: str) -> dict[str, Any]:
    cache = llama(8192)
    toks = list(range(8192))
    best: dict[str, float] = {}

    def keep(name: str, s: float) -> None:
        best[name] = min(best.get(name, float("inf")), s)

    with persist.Store(tmp / "a", shared=url) as a:
        t0 = time.perf_counter()
        info = a.save(cache, toks, identity=IDENTITY, session="s")
        keep("save with write-through (new to the tier)", time.perf_counter() - t0)
    nbytes = info.bytes
    raw = tmp / "raw.bin"
    raw.write_bytes(bytes(nbytes))
    dst = bytearray(nbytes)
    for i in range(REPS):
        with persist.Store(tmp / f"local{i}") as local:  # write-through off
            keep("save, local only", timed(lambda: local.save(cache, toks, identity=IDENTITY)))
        with persist.Store(tmp / f"wt{i}", shared=url) as wt:  # write-through on
            keep(
                "save with write-through (blobs already shared)",
                timed(lambda: wt.save(cache, toks, identity=IDENTITY)),
            )
        with persist.Store(tmp / f"b{i}", shared=url) as b:  # an empty machine
            keep("restore from Redis", timed(lambda: ev(b.restore("s", identity=IDENTITY))))
            keep("restore, local store", timed(lambda: ev(b.restore("s", identity=IDENTITY))))
        warm(raw)
        keep("raw read", timed(lambda: raw_read(raw, dst)))
    long = [*range(32768), 1]
    with persist.Store(tmp / "a2", shared=url) as a2:
        a2.save(llama(32768), long[:-1], identity=IDENTITY, session="long")
    with persist.Store(tmp / "c", shared=url) as c:
        assert c.shared is not None
        c.shared.agree(c.index, "default")
        secret = c.index.secret("default")
        assert secret is not None
        from persist.store.chains import chain_root, chains

        chs = chains(chain_root(secret, IDENTITY.digest), long, c.block_tokens)[1:]
        t = time.perf_counter()
        found = c.shared.tier.deepest_chain("default", chs)
        lookup_ms = 1e3 * (time.perf_counter() - t)
        assert found is not None and found[0] == 128
    return {
        "session_bytes": nbytes,
        "seconds": best,
        "lookup_32k": {"chains": len(chs), "round_trips": 2, "ms": lookup_ms},
    }


def ev(r: Any) -> None:
    mx.eval([c.state for c in r.cache])


def markdown(r: dict[str, Any]) -> str:
    s, gb = r["seconds"], r["session_bytes"] / GB
    lines = [
        "# The shared tier over loopback",
        "",
        f"{r['redis']}; an 8k-token Llama-3-8B-shaped session ({gb:.2f} GB), minimum of "
        f"{REPS} runs.",
        "",
        "| operation | seconds | GB/s |",
        "|---|---|---|",
        *(f"| {k} | {v:.3f} | {gb / v:.2f} |" for k, v in s.items()),
        "",
        f"Lookup of a 32k-token prompt in the tier: {r['lookup_32k']['chains']} chains in one "
        f"MGET plus one GET of the record, {r['lookup_32k']['ms']:.1f} ms.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
