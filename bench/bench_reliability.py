"""Run the long reliability suite and write bench/results/reliability.{json,md}.

    python -m bench.bench_reliability          # 200 kills, 10,000 fuzz cases, ...
    python -m bench.bench_reliability --short  # the CI sizes

Runs ``pytest tests/reliability`` with ``PERSIST_LONG=1``; every test tallies
its trials, the faults it injected, the errors it saw by type and any data
lost (which must be 0: a lost session fails its test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, machine, write_results

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        stats = Path(d) / "stats.json"
        env = {
            **os.environ,
            "PERSIST_RELIABILITY_STATS": str(stats),
            "PERSIST_LONG": "0" if args.short else "1",
        }
        t0 = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "tests/reliability"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        tallies = json.loads(stats.read_text()) if stats.exists() else {}
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-500:]
    lost = sum(t.get("data_lost", 0) for t in tallies.values())
    lines = [
        "# Reliability report",
        "",
        f"`python -m bench.bench_reliability{' --short' if args.short else ''}` on "
        f"{machine()['platform']}: pytest says **{summary}** in {seconds:.0f} s. "
        f"Data lost: **{lost}**.",
        "",
        "| category | trials and faults | errors seen, by type |",
        "|---|---|---|",
    ]
    for cat, t in sorted(tallies.items()):
        counts = ", ".join(f"{k} {v}" for k, v in sorted(t.items()) if not k.startswith("error:"))
        errors = ", ".join(f"{k[6:]} {v}" for k, v in sorted(t.items()) if k.startswith("error:"))
        lines.append(f"| {cat} | {counts} | {errors or '-'} |")
    lines += [
        "",
        "`none` counts cases that loaded and equalled the original exactly "
        "(harmless mutations such as header padding).",
    ]
    write_results(
        "reliability-short" if args.short else "reliability",
        {
            "summary": summary,
            "seconds": seconds,
            "data_lost": lost,
            "returncode": run.returncode,
            "tallies": tallies,
        },
        "\n".join(lines) + "\n",
    )
    print("\n".join(lines))
    if run.returncode:
        print(run.stdout[-3000:], run.stderr[-3000:])
        raise SystemExit(run.returncode)
    assert RESULTS.exists()


if __name__ == "__main__":
    main()
