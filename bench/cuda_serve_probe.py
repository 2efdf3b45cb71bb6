"""Where a ``persist serve`` hit's time goes on a GPU, in one fresh process (issue 39).

    python -m bench.cuda_serve_probe [--tokens 7168] [--out DIR]

The store and host tier built as ``persist serve`` builds them (``prepare()``
first), a Llama-3-8B-shaped cache saved, then: store lookups of it one after
another (the first and third profiled), lookups while another thread saves (as
the write-behind does), host-tier keeps of an evicted cache (the first grows the
pinned pool), host-tier hits, and a decode step on a restored cache against one
on the cache as computed.  JSON on stdout and in OUT/serve-probe.json; the
profiles in OUT/serve-probe-*.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _profiled(out: Path, name: str, fn: Any) -> Any:
    prof = cProfile.Profile()
    got = prof.runcall(fn)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    (out / f"serve-probe-{name}.txt").write_text(s.getvalue())
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=7168)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    import persist
    from bench.shapes import IDENTITY, first_step, llama
    from persist.engine.host.tier import HostTier
    from persist.engine.staged.restore import prepare
    from persist.serve.app import host_budget

    res: dict[str, Any] = {"tokens": args.tokens}
    t = time.perf_counter()
    res["prepared"] = prepare()
    res["prepare_s"] = time.perf_counter() - t
    n = args.tokens
    toks = list(range(n))
    ask = [*toks, 1, 2]

    def timed(fn: Any) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as d, persist.Store(Path(d) / "store") as store:
        host = HostTier(host_budget(None))
        res["host_where"] = host.where
        cache = llama(n)
        res["save_s"] = [timed(lambda: store.save(cache, toks, identity=IDENTITY, session="s"))]

        def lookup() -> Any:
            return store.lookup(ask, identity=IDENTITY, host=host, max_cost=math.inf)

        looks = []
        for i in range(5):
            mx.synchronize()
            t0 = time.perf_counter()
            hit = _profiled(args.out, f"lookup{i}", lookup) if i in (0, 2) else lookup()
            mx.synchronize()
            looks.append(time.perf_counter() - t0)
            assert hit is not None and len(hit.tokens) == n, hit
        res["lookup_s"] = looks
        res["lookup_source"] = hit.source
        # a step on the restored cache against one on the cache as computed
        res["step_restored_s"] = [timed(lambda: first_step(hit.cache)) for _ in range(3)]
        res["step_computed_s"] = [timed(lambda: first_step(cache)) for _ in range(3)]
        # lookups while another thread saves (the write-behind)
        other = llama(n)
        busy = []
        for j in range(3):
            th = threading.Thread(
                target=lambda j=j: store.save(
                    other, [7 + j, *toks[1:]], identity=IDENTITY, session=f"o{j}"
                )
            )
            th.start()
            time.sleep(0.02)
            busy.append(timed(lookup))
            th.join()
        res["lookup_beside_save_s"] = busy
        # the host tier: keeps of evicted caches (the first grows the pinned pool), hits
        keeps = []
        for j in range(3):
            ev = llama(n)
            keeps.append(timed(lambda ev=ev, j=j: host.keep("o", [50 + j, *toks[1:]], ev)))
        res["host_keep_s"] = keeps
        from persist.engine.host.store_hooks import owner

        who = owner("default", IDENTITY, store.strict_backend)
        host.keep(who, toks, llama(n))
        hits = []
        for _ in range(3):
            mx.synchronize()
            t0 = time.perf_counter()
            h = lookup()
            mx.synchronize()
            hits.append(time.perf_counter() - t0)
        res["host_lookup_s"], res["host_lookup_source"] = hits, h.source
        res["data_paths"] = store.stats().data_paths
    text = json.dumps(res, indent=1, default=str)
    (args.out / "serve-probe.json").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
