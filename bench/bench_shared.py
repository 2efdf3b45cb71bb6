"""The tiers over loopback, one run: an 8k Llama-3-8B-shaped session restored from Redis
and from S3 (moto's server mode) on an empty machine, beside the local store and the raw
read; the lookup of a 32k-token prompt (round trips, ms); save throughput with
write-through on and off; and the cost of authentication (an operator key: HMAC-SHA256
over every record, pointer and blob), each operation with and without a key, interleaved.

    python -m bench.bench_shared            # starts its own redis-server and moto_server
    python -m bench.bench_shared --small    # a 2k-token session, an 8k-token lookup

Results in bench/results/shared.json and .md (shared-small.* for --small).  Minimum of
interleaved runs.
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import persist
from bench.common import RESULTS, machine, raw_read, warm
from bench.shapes import IDENTITY, llama
from tests.tiers.conftest import RedisServer, S3Server

REPS = 3
KEY_REPS = 10  # restores with and without a key: the machine is shared, minimum of many
GB = 1e9
SMALL = "--small" in sys.argv
SESSION, LONG = (2048, 8192) if SMALL else (8192, 32768)
KEY = bytes(range(32))
# a build without tier keys (to measure the one before them) runs the keyless rows only
KEYED = "tier_key" in inspect.signature(persist.Store).parameters


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
        r = run(tmp, server.url) if not SMALL else {"seconds": {}}
        r.update(run_keys(tmp, server.url))
        if not SMALL:
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
    name = "shared-small" if SMALL else "shared"
    (RESULTS / f"{name}.json").write_text(json.dumps(r, indent=2) + "\n")
    md = markdown(r)
    (RESULTS / f"{name}.md").write_text(md)
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
        from persist.engine.tiers.exchange.records import Expect

        from persist.storage.chains import chain_root, chains, head_key

        every = chains(chain_root(secret, IDENTITY.digest), long, c.block_tokens)
        b = c.block_tokens
        heads = [head_key(h, long[i * b :]) for i, h in enumerate(every) if len(long) - i * b >= 16]
        want = Expect("default", secret=secret, block=b, identity=IDENTITY.digest)
        t = time.perf_counter()
        found = c.shared._deepest(c.index, "default", every[1:], heads, want)
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


def keyed(key: bytes | None) -> dict[str, Any]:
    return {"tier_key": key} if key is not None else {}


def cpu_s(redis: Any) -> float:
    """CPU seconds so far of this process and of the redis-server (user + system)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    info = redis.info("cpu")
    return float(me.ru_utime + me.ru_stime + info["used_cpu_user"] + info["used_cpu_sys"])


def run_keys(tmp: Path, url: str) -> dict[str, Any]:
    """Each operation on the shared tier with and without an operator key, interleaved
    (the order alternates: a restore right after another pays for fresh memory): a
    save new to the tier, a restore on an empty machine (its wall time, and the CPU
    seconds of this process and the redis-server: on a shared machine the CPU is
    what a key adds), and a lookup of a LONG-token prompt in the tier (the full
    pull_prefix path on a machine that already holds the snapshot: pointers,
    records, their checks; nothing is pulled)."""
    import redis

    cache, toks = llama(SESSION), list(range(SESSION))
    long = [*range(LONG), 1]
    best: dict[str, float] = {}
    variants = [("no key", None), *([("key", KEY)] if KEYED else [])]
    client = redis.Redis.from_url(url)

    def keep(name: str, s: float) -> None:
        best[name] = min(best.get(name, float("inf")), s)

    stores = {}
    for label, key in variants:  # the namespaces: one per variant, on one server
        ns = f"bench-{label}".replace(" ", "-")
        a = persist.Store(tmp / f"k-{ns}", shared=url, **keyed(key))
        keep(
            f"save, new to the tier ({label})",
            timed(
                lambda a=a, ns=ns: a.save(cache, toks, identity=IDENTITY, session="s", namespace=ns)
            ),
        )
        a.save(llama(LONG), long[:-1], identity=IDENTITY, namespace=ns)
        stores[label] = (a, ns)
    for i in range(KEY_REPS):
        for label, key in variants if i % 2 == 0 else variants[::-1]:
            a, ns = stores[label]
            with persist.Store(tmp / f"kb-{label}-{i}", shared=url, **keyed(key)) as b:
                c = cpu_s(client)
                s = timed(lambda b=b, ns=ns: ev(b.restore("s", identity=IDENTITY, namespace=ns)))
                keep(f"restore from Redis ({label})", s)
                keep(f"restore from Redis, CPU seconds ({label})", cpu_s(client) - c)
            assert a.shared is not None
            for _ in range(20):
                t = time.perf_counter()
                a.shared.pull_prefix(
                    a.index,
                    a.blobs,
                    long,
                    identity=IDENTITY,
                    namespace=ns,
                    block=a.block_tokens,
                )
                keep(f"lookup of {LONG} tokens in the tier ({label})", time.perf_counter() - t)
    for a, _ in stores.values():
        a.close()
    return {"keys": best, "session_bytes": cache_bytes(toks)}


def cache_bytes(toks: list[int]) -> int:
    return len(toks) * 32 * 2 * 8 * 128 * 2  # 32 layers, K and V, 8 heads of 128, bf16


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


def ratios(k: dict[str, float]) -> list[str]:
    """With a key against without, for the restore (wall and CPU) and the lookup."""
    out = []
    for what in (
        "restore from Redis",
        "restore from Redis, CPU seconds",
        f"lookup of {LONG} tokens in the tier",
    ):
        if f"{what} (key)" in k:
            out.append(f"{what}: {k[f'{what} (key)'] / k[f'{what} (no key)']:.3f}x with a key")
    return [*(f"- {line}" for line in out), ""] if out else []


def ev(r: Any) -> None:
    mx.eval([c.state for c in r.cache])


def markdown(r: dict[str, Any]) -> str:
    s, gb = r["seconds"], r["session_bytes"] / GB
    k = r["keys"]
    auth = [
        "## The cost of authentication",
        "",
        f"A {SESSION}-token session ({gb:.2f} GB) and a {LONG}-token lookup, without and "
        "with an operator key (HMAC-SHA256 over every record, pointer and blob), interleaved.",
        "",
        "| operation | seconds |",
        "|---|---|",
        *(f"| {name} | {v:.4f} |" for name, v in k.items()),
        "",
        *ratios(k),
    ]
    if SMALL:
        return "\n".join(["# The shared tier over loopback (small run)", "", *auth])
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
        *auth,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
