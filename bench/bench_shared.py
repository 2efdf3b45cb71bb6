"""The tiers over loopback, one run: an 8k Llama-3-8B-shaped session restored from Redis
and from S3 (moto's server mode) on an empty machine, beside the local store and the raw
read; the lookup of a 32k-token prompt (round trips, ms); save throughput with
write-through on and off.

    python -m bench.bench_shared            # starts its own redis-server and moto_server

Results in bench/results/shared.json and .md.  Minimum of interleaved runs.
"""

from __future__ import annotations

import json
import os
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
from tests.tiers.conftest import RedisServer, S3Server

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
    s3 = S3Server(tmp)
    os.environ.update(
        AWS_ENDPOINT_URL=s3.endpoint,
        AWS_ALLOW_HTTP="true",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        s3.start()
        r = run(tmp, server.url)
        r["seconds"].update(run_s3(tmp, s3.url))
        r["redis"] = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip()
    finally:
        server.stop()
        s3.stop()
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
        from persist.store.chains import chain_root, chains, head_key

        every = chains(chain_root(secret, IDENTITY.digest), long, c.block_tokens)
        b = c.block_tokens
        heads = [head_key(h, long[i * b :]) for i, h in enumerate(every) if len(long) - i * b >= 16]
        t = time.perf_counter()
        found = c.shared.tier.deepest_chain("default", every[1:], heads)
        lookup_ms = 1e3 * (time.perf_counter() - t)
        assert len(found) == 1  # the snapshot at the end of all 128 blocks
    return {
        "session_bytes": nbytes,
        "seconds": best,
        "lookup_32k": {
            "chains": len(every) - 1,
            "heads": len(heads),
            "round_trips": 2,
            "ms": lookup_ms,
        },
    }


def run_s3(tmp: Path, url: str) -> dict[str, float]:
    """The cold tier: a save that writes a named session through to S3, and restores
    of it on empty machines (moto keeps objects in memory, in one Python process)."""
    cache, toks = llama(8192), list(range(8192))
    best: dict[str, float] = {}
    with persist.Store(tmp / "s3a", cold=url) as a:
        best["save with write-through to S3 (new)"] = timed(
            lambda: a.save(cache, toks, identity=IDENTITY, session="s")
        )
    for i in range(REPS):
        with persist.Store(tmp / f"s3b{i}", cold=url) as b:
            s = timed(lambda: ev(b.restore("s", identity=IDENTITY)))
            best["restore from S3"] = min(best.get("restore from S3", float("inf")), s)
    return best


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
        f"Lookup of a 32k-token prompt in the tier: {r['lookup_32k']['chains']} chains and "
        f"{r['lookup_32k']['heads']} head keys in one MGET plus one GET of the record, "
        f"{r['lookup_32k']['ms']:.1f} ms.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
