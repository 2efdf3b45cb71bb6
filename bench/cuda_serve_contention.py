"""Does persist serve's background work (the write-behind's saves, the host tier's
copies of evicted caches) slow the next request?  Misses only, on MLX's CUDA
backend (issue 39): each server gets unseen prompts back to back ("busy": persist's
writer and keeper still work on the previous request's caches) and after persist
has gone idle ("idle": its write queue empty, then a pause), in one run.

    python -m bench.cuda_serve_contention [--shape llama3-8b] [--n 4] [--out DIR]
        [--switch-interval S] [--pyspy PATH]

``--switch-interval``: persist serve's Python thread switch interval (a sitecustomize on
its path only: what the generation thread waits for the GIL behind background work);
``--pyspy``: py-spy samples persist serve's GIL holder, by thread, into OUT.

Plain ``mlx_lm.server`` gets the same prompts at the same moments, so the ratio
of persist's TTFT to plain's in each mode tells what the overlap costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_e2e import SHAPES, quiet, sampling, scrape, start, streamed, unseen
from persist.apps.demo import make_model


def idle(port: int, settle: float) -> None:
    """Wait for persist's write queue to empty (bounded), then ``settle`` seconds."""
    quiet(port)
    time.sleep(settle)


def start_persist(model: Path, tmp: Path, interval: float | None) -> Any:
    """persist serve, with Python's switch interval set to ``interval`` in it alone."""
    if interval is None:
        return start("persist", model, tmp, 2)[0]
    site = tmp / "switch"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.setswitchinterval({interval})\n")
    before = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), before) if p)
    try:
        return start("persist", model, tmp, 2)[0]
    finally:
        os.environ["PYTHONPATH"] = before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--chars", type=int, default=12000)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--model", type=Path, help="an existing model folder (skip making one)")
    ap.add_argument("--switch-interval", type=float)
    ap.add_argument("--pyspy", help="py-spy's path: sample persist serve's GIL holder")
    args = ap.parse_args()
    tag = "" if args.switch_interval is None else f"-si{args.switch_interval:g}"
    res: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = args.model or make_model(tmp / "model", "llama", overrides=SHAPES[args.shape])
        servers = {"plain": start("plain", model, tmp, 2)[0],
                   "persist": start_persist(model, tmp, args.switch_interval)}  # fmt: skip
        spy = None
        if args.pyspy:
            args.out.mkdir(parents=True, exist_ok=True)
            out = args.out / f"serve-contention{tag}-gil.txt"
            spy = sampling(args.pyspy, servers["persist"], out, "--gil", rate=250)
        try:
            for srv in servers.values():  # kernels compiled: not timed
                streamed(srv.port, [{"role": "user", "content": "warm up"}], 2)
            for mode in ("busy", "idle", "busy", "idle"):
                for i in range(args.n):
                    if mode == "idle":
                        idle(servers["persist"].port, 2.0)
                    order = ["plain", "persist"] if i % 2 else ["persist", "plain"]
                    prompt = unseen(f"{mode} {i} {time.time()}", args.chars)
                    for k in order:
                        r = streamed(servers[k].port, prompt, 1)
                        res.setdefault(mode, {}).setdefault(k, []).append(r["ttft"])
            metrics = scrape(servers["persist"].port)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            for srv in servers.values():
                srv.stop()
    report = {m: {k: sorted(v) for k, v in by.items()} for m, by in res.items()}
    for m, by in report.items():
        p, q = by["persist"], by["plain"]
        print(f"{m}: persist median {p[len(p) // 2]:.3f} plain median {q[len(q) // 2]:.3f} "
              f"ratio {p[len(p) // 2] / q[len(q) // 2]:.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"serve-contention{tag}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"serve-contention{tag}-metrics.txt").write_text(metrics)


if __name__ == "__main__":
    main()
