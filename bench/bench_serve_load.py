"""``persist serve`` under load, beside plain ``mlx_lm.server`` on the same tiny models.

    python -m bench.bench_serve_load            # 8 clients x 10 turns, bursts of 32
    python -m bench.bench_serve_load --quick    # 4 x 3, bursts of 12
    python -m bench.bench_serve_load --quick --models llama --scrape   # /metrics cost
    python -m bench.bench_serve_load --ab 8     # /metrics cost, scraped and unscraped rounds

``--scrape`` adds a third run of ``persist serve`` whose /metrics and
/health are fetched every ``--scrape-every`` seconds throughout (default 1:
15x a 15 s Prometheus scrape): its latencies beside the unscraped run's
are what metrics cost under load.  After the load, the server's CPU time
for 100 scrapes of each endpoint, less that of an idle window as long, is
the cost of one scrape (a figure the machine's other load barely moves).
``--ab N`` runs one ``persist serve`` and N rounds of 4 simultaneous
distinct ~2,000-token prompts, every other round scraped: alternating
cancels the drift of a shared machine's load between whole runs.

For each model and server, one at a time on 127.0.0.1: conversation clients
sharing a ~2,000-token system prompt, each with its own turns; then a burst
of simultaneous clients with distinct ~2,000-token prompts; then SIGTERM.
The server's RSS is sampled throughout.  Reported: latency p50/p95/max,
wall time, errors, cached tokens, write-behind drops, shutdown time, peak
RSS, store entries and bytes.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

import persist
from bench.common import machine, write_results
from bench.servers import Server
from persist.apps.demo import make_model

SYSTEM = " ".join(f"rule {i}: keep item {i % 37} dry." for i in range(70))  # ~2,000 tokens (bytes)


class RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.peak, self.done = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.1)


def conversation(srv: Server, who: int, turns: int, out: list[Any]) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Client {who}, question {t}: what next?"})
        t0 = time.perf_counter()
        try:
            resp = srv.chat(messages, max_tokens=8)
        except Exception as e:  # counted, not fatal: the table reports errors
            out.append(("error", repr(e)))
            return
        out.append((time.perf_counter() - t0, cached(resp)))
        messages.append({"role": "assistant", "content": resp["choices"][0]["message"]["content"]})


def one_shot(srv: Server, who: int, out: list[Any]) -> None:
    body = " ".join(f"note {who}-{k} stays." for k in range(120))  # ~2,000 distinct tokens (bytes)
    t0 = time.perf_counter()
    try:
        resp = srv.chat([{"role": "user", "content": body}], max_tokens=8)
    except Exception as e:  # counted, not fatal
        out.append(("error", repr(e)))
        return
    out.append((time.perf_counter() - t0, cached(resp)))


def cached(resp: dict[str, Any]) -> int:
    return int(resp.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0))


def run_threads(targets: list[Any]) -> float:
    threads = [threading.Thread(target=f) for f in targets]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


class Scraper(threading.Thread):
    """GET /metrics and /health every ``every`` seconds; the scrapes' own latencies."""

    def __init__(self, port: int, every: float) -> None:
        super().__init__(daemon=True)
        self.port, self.every, self.done = port, every, threading.Event()
        self.seconds: list[float] = []

    def run(self) -> None:
        while not self.done.wait(self.every):
            for path in ("/metrics", "/health"):
                t0 = time.perf_counter()
                self.get(path)
                self.seconds.append(time.perf_counter() - t0)

    def get(self, path: str) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            r.read()

    def cpu_per_scrape(self, pid: int, n: int = 100) -> dict[str, float]:
        """Server CPU seconds for one scrape of each endpoint (an idle window subtracted)."""
        proc, out = psutil.Process(pid), {}
        for path in ("/metrics", "/health"):
            c0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            for _ in range(n):
                self.get(path)
            busy, wall = sum(proc.cpu_times()[:2]) - c0, time.perf_counter() - t0
            c1 = sum(proc.cpu_times()[:2])
            time.sleep(wall)
            idle = sum(proc.cpu_times()[:2]) - c1
            out[path] = max(0.0, busy - idle) / n
        return out


def measure(
    args: list[str], log: Path, clients: int, turns: int, burst: int, scrape: float = 0.0
) -> dict[str, Any]:
    srv = Server(args, log)
    rss = RssSampler(srv.proc.pid)
    rss.start()
    scraper = Scraper(srv.port, scrape) if scrape else None
    if scraper is not None:
        scraper.start()
    results: list[Any] = []
    wall = run_threads([lambda i=i: conversation(srv, i, turns, results) for i in range(clients)])
    wall += run_threads([lambda i=i: one_shot(srv, i, results) for i in range(burst)])
    cpu: dict[str, float] = {}
    if scraper is not None:
        scraper.done.set()
        scraper.join()
        cpu = scraper.cpu_per_scrape(srv.proc.pid)
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(timeout=300)
    shutdown = time.perf_counter() - t0
    srv.log.close()
    rss.done.set()
    times = sorted(r[0] for r in results if r[0] != "error")
    scrapes = sorted(scraper.seconds) if scraper is not None else []
    return {
        "scrapes": len(scrapes),
        "scrape_every_s": scrape,
        "scrape_cpu_s": cpu,
        "scrape_p50_s": statistics.median(scrapes) if scrapes else 0.0,
        "requests": len(results),
        "errors": sum(1 for r in results if r[0] == "error"),
        "p50_s": statistics.median(times) if times else 0.0,
        "p95_s": times[int(0.95 * (len(times) - 1))] if times else 0.0,
        "max_s": times[-1] if times else 0.0,
        "wall_s": wall,
        "cached_tokens": sum(r[1] for r in results if r[0] != "error"),
        "shutdown_s": shutdown,
        "exit_code": code,
        "rss_peak_mb": rss.peak / 2**20,
        "traceback_in_log": "Traceback" in log.read_text(errors="replace"),
    }


def ab_rounds(model: Path, store: Path, log: Path, rounds: int, every: float) -> dict[str, Any]:
    """Alternate unscraped and scraped rounds on one server; each round's p50."""
    srv = Server(["persist", "serve", "--model", str(model), "--store", str(store)], log)
    p50: dict[str, list[float]] = {"unscraped": [], "scraped": []}
    try:
        for r in range(rounds):
            scraper = Scraper(srv.port, every) if r % 2 else None
            if scraper is not None:
                scraper.start()
            results: list[Any] = []
            who = [1000 * r + i for i in range(4)]  # distinct prompts: no cache hits
            run_threads([lambda w=w, out=results: one_shot(srv, w, out) for w in who])
            if scraper is not None:
                scraper.done.set()
                scraper.join()
            times = [x[0] for x in results if x[0] != "error"]
            p50["scraped" if scraper else "unscraped"].append(statistics.median(times))
    finally:
        srv.stop()
    return {"rounds": rounds, "scrape_every_s": every, "p50_s": p50}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="llama,qwen3_next", help="comma-separated archs")
    ap.add_argument("--scrape", action="store_true", help="add a run scraped throughout")
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    ap.add_argument("--ab", type=int, default=0, help="only: N alternating rounds, one server")
    a = ap.parse_args()
    if a.ab:
        with tempfile.TemporaryDirectory() as d:
            model = make_model(Path(d) / "llama", "llama")
            ab = ab_rounds(model, Path(d) / "store", Path(d) / "ab.log", a.ab, a.scrape_every)
        ab["machine"] = machine()
        md = ab_markdown(ab)
        write_results("serve-load-metrics-ab", ab, md)
        print(md)
        return
    clients, turns, burst = (4, 3, 12) if a.quick else (8, 10, 32)
    out: dict[str, Any] = {"clients": clients, "turns": turns, "burst": burst, "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for arch in a.models.split(","):
            model = make_model(tmp / arch, arch)
            plain = measure(
                ["mlx_lm.server", "--model", str(model)], tmp / f"{arch}-plain.log",
                clients, turns, burst,
            )  # fmt: skip
            store = tmp / f"{arch}-store"
            mine = measure(
                ["persist", "serve", "--model", str(model), "--store", str(store)],
                tmp / f"{arch}-persist.log", clients, turns, burst,
            )  # fmt: skip
            store_facts(store, mine)
            out["runs"][arch] = {"plain mlx_lm.server": plain, "persist serve": mine}
            if a.scrape:
                scraped = measure(
                    ["persist", "serve", "--model", str(model), "--store", str(tmp / "scraped")],
                    tmp / f"{arch}-scraped.log", clients, turns, burst, scrape=a.scrape_every,
                )  # fmt: skip
                label = f"persist serve, scraped every {a.scrape_every:g} s"
                out["runs"][arch][label] = store_facts(tmp / "scraped", scraped)
    out["machine"] = machine()
    md = markdown(out, a.quick)
    name = "serve-load-metrics" if a.scrape else "serve-load"
    write_results(f"{name}-quick" if a.quick else name, out, md)
    print(md)


def ab_markdown(ab: dict[str, Any]) -> str:
    rows = [
        f"| {arm} | " + " ".join(f"{x:.2f}" for x in xs) + f" | {statistics.median(xs):.2f} |"
        for arm, xs in ab["p50_s"].items()
    ]
    return (
        "\n".join(
            [
                "# persist serve: what /metrics costs (alternating rounds)",
                "",
                f"`python -m bench.bench_serve_load --ab {ab['rounds']}` on "
                f"{ab['machine']['platform']}: one `persist serve` (tiny llama), rounds of 4 "
                "simultaneous distinct ~2,000-token prompts; every other round /metrics and "
                f"/health are fetched every {ab['scrape_every_s']:g} s.",
                "",
                "| rounds | p50 s of each round | median |",
                "|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )


def store_facts(store: Path, run: dict[str, Any]) -> dict[str, Any]:
    with persist.Store(store) as s:
        st = s.stats()
        run |= {
            "drops": st.counters.get("serve_queue_drops", 0),
            "persisted": st.counters.get("serve_persisted", 0),
            "entries": st.entries,
            "store_bytes": st.unique_bytes,
            "check_clean": s.check() == [],
        }
    return run


def markdown(out: dict[str, Any], quick: bool) -> str:
    lines = [
        "# persist serve under load",
        "",
        f"`python -m bench.bench_serve_load{' --quick' if quick else ''}` on "
        f"{out['machine']['platform']}: {out['clients']} conversation clients x {out['turns']} "
        f"turns sharing a ~2,000-token system prompt, then a burst of {out['burst']} "
        "simultaneous ~2,000-token prompts, then SIGTERM; tiny random-weight models.",
        "",
        "| model | server | p50 s | p95 s | max s | wall s | errors | cached tokens | drops "
        "| shutdown s | exit | RSS peak MB | entries | store KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, runs in out["runs"].items():
        for name, r in runs.items():
            lines.append(
                f"| {arch} | {name} | {r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['max_s']:.3f} "
                f"| {r['wall_s']:.1f} | {r['errors']} | {r['cached_tokens']} "
                f"| {r.get('drops', '-')} | {r['shutdown_s']:.2f} | {r['exit_code']} "
                f"| {r['rss_peak_mb']:.0f} | {r.get('entries', '-')} "
                f"| {r['store_bytes'] / 1024:.0f} |"
                if "store_bytes" in r
                else f"| {arch} | {name} | {r['p50_s']:.3f} | {r['p95_s']:.3f} | {r['max_s']:.3f} "
                f"| {r['wall_s']:.1f} | {r['errors']} | {r['cached_tokens']} | - "
                f"| {r['shutdown_s']:.2f} | {r['exit_code']} | {r['rss_peak_mb']:.0f} | - | - |"
            )
    for arch, runs in out["runs"].items():
        for name, r in runs.items():
            if r.get("scrapes"):
                cpu = ", ".join(
                    f"{path} {1000 * sec:.2f} ms" for path, sec in r["scrape_cpu_s"].items()
                )
                lines.append(
                    f"\n{arch}, {name}: {r['scrapes']} scrapes of /metrics and /health "
                    f"during the run, p50 {1000 * r['scrape_p50_s']:.1f} ms each; "
                    f"server CPU per scrape, idle: {cpu}."
                )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
