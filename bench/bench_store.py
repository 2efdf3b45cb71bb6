"""The store: save/restore speed, incremental turns, lookup latency, time to first token.

    python -m bench.bench_store            # the full run, results in bench/results/store.*
    python -m bench.bench_store --quick    # small sizes, for a smoke run

Everything side by side in one run: the store against save_file/load_file,
mlx-lm's save/load_prompt_cache and the machine's raw limits.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgpack
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import persist
from bench.common import (
    SHAPES,
    SMALL_LLAMA,
    evict,
    interleaved,
    kv_cache,
    machine,
    raw_ops,
    warm,
    write_results,
)
from persist.engine.blocks import chain_root, chains, head_key
from persist.format.tokens import pack_tokens
from persist.storage import writes
from persist.storage.index import BlockRef

GB = 1e9
IDENTITY = persist.ModelIdentity("bench", "c", "w", "t", "h", name="bench")


def speed(shape: str, tokens: int, tmp: Path, reps: int) -> dict[str, Any]:
    cache = kv_cache(shape, tokens)
    toks = list(range(tokens))
    f, m = tmp / "f.safetensors", tmp / "m.safetensors"
    store = persist.Store(tmp / "store")
    persist.save_file(f, cache, toks)
    save_prompt_cache(str(m), cache)

    def store_save() -> None:
        store.delete("s") if store.sessions() else None
        store.gc()
        store.save(cache, toks, identity=IDENTITY, session="s")

    def store_restore() -> None:
        mx.eval([c.state for c in store.restore("s", identity=IDENTITY).cache])

    def store_files() -> list[Path]:
        return list((tmp / "store" / "blobs").rglob("*.safetensors"))

    store_save()
    ops = {
        "store save": (None, store_save),
        "save_file": (None, lambda: persist.save_file(f, cache, toks)),
        "mlx-lm save": (None, lambda: save_prompt_cache(str(m), cache)),
        "store restore (warm)": (lambda: [warm(p) for p in store_files()], store_restore),
        "load_file (warm)": (lambda: warm(f), lambda: persist.load_file(f)),
        "mlx-lm load (warm)": (
            lambda: warm(m),
            lambda: mx.eval([c.state for c in load_prompt_cache(str(m))]),
        ),
        "store restore (cold)": (lambda: [evict(p) for p in store_files()], store_restore),
        "load_file (cold)": (lambda: evict(f), lambda: persist.load_file(f)),
        **{f"raw {k}": v for k, v in raw_ops(f.stat().st_size, tmp).items()},
    }
    times = interleaved(ops, reps)
    size = sum(p.stat().st_size for p in store_files())
    store.close()
    return {
        "shape": shape,
        "tokens": tokens,
        "store_bytes": size,
        "file_bytes": f.stat().st_size,
        "mlx_lm_bytes": m.stat().st_size,
        "seconds": times,
    }


def turn_cost(shape: str, tokens: int, new: int, tmp: Path) -> dict[str, Any]:
    """Saving turn n+1 (``new`` tokens more) of a session, against rewriting it whole."""
    cache = kv_cache(shape, tokens)
    toks = list(range(tokens))
    with persist.Store(tmp / "turns") as store:
        store.save(cache, toks, identity=IDENTITY, session="conv")
        _, heads, dim = SHAPES[shape]
        for c in cache:
            k = mx.random.normal((1, heads, new, dim)).astype(mx.bfloat16)
            c.update_and_fetch(k, k)
        mx.eval([c.state for c in cache])
        toks2 = toks + list(range(tokens, tokens + new))
        before = store.stats().counters.get("bytes_written", 0)
        t0 = time.perf_counter()
        store.save(cache, toks2, identity=IDENTITY, session="conv")
        inc = time.perf_counter() - t0
        written = store.stats().counters["bytes_written"] - before
    with persist.Store(tmp / "fresh") as fresh:
        t0 = time.perf_counter()
        fresh.save(cache, toks2, identity=IDENTITY, session="conv")
        full = time.perf_counter() - t0
        full_bytes = fresh.stats().unique_bytes
    return {
        "shape": shape,
        "tokens": tokens,
        "new_tokens": new,
        "incremental_s": inc,
        "full_rewrite_s": full,
        "incremental_bytes": written,
        "full_bytes": full_bytes,
    }


def lookup_latency(n: int, tmp: Path, probes: int = 300) -> dict[str, Any]:
    """Median ``find`` time with ``n`` snapshots in the index (rows made directly)."""
    rng = random.Random(0)
    store = persist.Store(tmp / "many")
    tiny = make_prompt_cache_tiny()
    base = store.save(tiny, [1, 2, 3], identity=IDENTITY, session="seed")
    row = store.index.get(base.id)
    assert row is not None
    secret = store.index.secret("default", lambda: b"")
    root = chain_root(secret, IDENTITY.digest)
    prefixes = [[rng.randrange(50_000) for _ in range(512)] for _ in range(200)]
    stored: list[list[int]] = []
    with store.index.write() as db:
        for i in range(n):
            toks = prefixes[i % 200][: rng.randrange(0, 512)] + [
                rng.randrange(50_000) for _ in range(rng.randrange(16, 400))
            ]
            chs = chains(root, toks, store.block_tokens)
            refs = [BlockRef(j, chs[j + 1], None) for j in range(len(chs) - 1)]
            writes.insert(
                db,
                {
                    "namespace": "default",
                    "name": None,
                    "owner": None,
                    "role": "prefix",
                    "identity": IDENTITY.digest,
                    "identity_map": row.identity_map,
                    "root": root,
                    "last_chain": chs[-1] if len(chs) > 1 else head_key(root, toks),
                    "n_blocks": len(refs),
                    "n_tokens": len(toks),
                    "tokens": pack_tokens(toks),
                    "trimmable": 1,
                    "min_resume": 0,
                    "manifest": row.manifest,
                    "tail": row.tail,
                    "bytes": row.nbytes,
                    "pinned": 0,
                    "created": float(i),
                    "used": float(i),
                    "metadata": msgpack.packb({}),
                },
                refs,
            )
            sid = db.execute("SELECT MAX(id) FROM snapshots").fetchone()[0]
            writes.add_heads(db, sid, chs, toks, store.block_tokens)
            if i % 500 == 0:
                stored.append(toks)
    hits, misses = [], []
    for i in range(probes):
        known = stored[i % len(stored)]
        prompt = known + [rng.randrange(50_000) for _ in range(50)]
        t0 = time.perf_counter()
        found = store.find(prompt, identity=IDENTITY)
        hits.append(time.perf_counter() - t0)
        assert found is not None
        fresh = [rng.randrange(50_000) for _ in range(rng.randrange(100, 2000))]
        t0 = time.perf_counter()
        store.find(fresh, identity=IDENTITY)
        misses.append(time.perf_counter() - t0)
    store.close()
    return {
        "snapshots": n + 1,
        "hit_median_ms": 1e3 * statistics.median(hits),
        "miss_median_ms": 1e3 * statistics.median(misses),
        "hit_p95_ms": 1e3 * sorted(hits)[int(0.95 * len(hits))],
    }


def make_prompt_cache_tiny() -> list[Any]:
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    k = mx.zeros((1, 1, 3, 8), dtype=mx.bfloat16)
    c.update_and_fetch(k, k)
    return [c]


def ttft(tokens: int, tmp: Path) -> dict[str, Any]:
    """Time to first token: restore a session and decode, against prefilling it again."""
    from mlx_lm import load

    from persist.apps.demo import make_model

    d = make_model(
        tmp / "model",
        "llama",
        overrides=SMALL_LLAMA,
    )
    model, tok = load(str(d))
    identity = persist.ModelIdentity.of(model, tok)
    toks = [random.Random(1).randrange(256) for _ in range(tokens)]

    def first_token(cache: list[Any], feed: list[int]) -> int:
        for i in range(0, len(feed), 512):
            logits = model(mx.array([feed[i : i + 512]]), cache=cache)
        return int(mx.argmax(logits[0, -1]).item())

    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    want = first_token(cache, toks)
    recompute = time.perf_counter() - t0
    with persist.Store(tmp / "ttft") as store:
        store.save(copy.deepcopy(cache), toks, identity=identity, session="s")
        cache2 = make_prompt_cache(model)
        first_token(cache2, toks[:-1])
        store.save(cache2, toks[:-1], identity=identity, session="s")
        for p in (tmp / "ttft" / "blobs").rglob("*.safetensors"):
            evict(p)
        t0 = time.perf_counter()
        restored = store.restore("s", identity=identity)
        got = first_token(restored.cache, toks[-1:])
        resumed = time.perf_counter() - t0
    assert got == want
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {
        "tokens": tokens,
        "params": params,
        "recompute_s": recompute,
        "restore_cold_s": resumed,
        "speedup": recompute / resumed,
    }


def markdown(r: dict[str, Any]) -> str:
    lines = [
        "# Store benchmark",
        "",
        f"Machine: {r['machine']['platform']}, "
        f"{r['machine']['cpus']} CPUs. Median of 3 interleaved runs after a warm-up round.",
        "",
    ]
    for s in r["speed"]:
        gb = s["file_bytes"] / GB
        lines += [
            f"## {s['shape']}, {s['tokens']} tokens ({s['store_bytes'] / 2**20:.0f} MiB "
            f"in the store, {s['mlx_lm_bytes'] / 2**20:.0f} MiB with mlx-lm)",
            "",
            "| operation | seconds | GB/s |",
            "|---|---|---|",
        ]
        for k, v in s["seconds"].items():
            lines.append(f"| {k} | {v:.3f} | {gb / v:.2f} |")
        lines.append("")
    t = r["turn"]
    lines += [
        "## Incremental save",
        "",
        f"Turn n+1 of a {t['tokens']}-token {t['shape']} conversation ({t['new_tokens']} "
        f"new tokens): {t['incremental_s']:.3f} s and {t['incremental_bytes'] / 2**20:.1f} "
        f"MiB written, against {t['full_rewrite_s']:.3f} s and "
        f"{t['full_bytes'] / 2**20:.1f} MiB for a full rewrite: "
        f"{t['incremental_s'] / t['full_rewrite_s']:.3f}x the time, "
        f"{t['incremental_bytes'] / t['full_bytes']:.3f}x the bytes.",
        "",
    ]
    lk = r["lookup"]
    lines += [
        "## Lookup latency",
        "",
        f"{lk['snapshots']:,} snapshots in the index: median {lk['hit_median_ms']:.2f} ms "
        f"for a prompt with a stored prefix (p95 {lk['hit_p95_ms']:.2f} ms), "
        f"{lk['miss_median_ms']:.2f} ms for a miss (index decision, no blob read).",
        "",
    ]
    tt = r["ttft"]
    lines += [
        "## Time to first token",
        "",
        f"A {tt['params'] / 1e6:.0f}M-parameter llama-shaped model (random weights), "
        f"{tt['tokens']}-token session: recomputing the prefill takes "
        f"{tt['recompute_s']:.2f} s; restoring it from the store (cold page cache) and "
        f"decoding the next token takes {tt['restore_cold_s']:.3f} s: "
        f"**{tt['speedup']:.0f}x** faster, same first token.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        if args.quick:
            r = {
                "speed": [speed("qwen2.5-0.5b", 1000, tmp / "a", 2)],
                "turn": turn_cost("qwen2.5-0.5b", 1024, 256, tmp / "b"),
                "lookup": lookup_latency(2000, tmp / "c", 50),
                "ttft": ttft(512, tmp / "d"),
            }
        else:
            r = {
                "speed": [speed("llama3-8b", 8000, tmp / "a", 3)],
                "turn": turn_cost("llama3-8b", 8192, 256, tmp / "b"),
                "lookup": lookup_latency(100_000, tmp / "c"),
                "ttft": ttft(4096, tmp / "d"),
            }
            print(json.dumps(r["speed"]), flush=True)
    r["machine"] = machine()
    name = "store-quick" if args.quick else "store"
    write_results(name, r, markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
