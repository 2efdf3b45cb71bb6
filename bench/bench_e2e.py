"""``persist serve`` against plain ``mlx_lm.server``, end to end, in one run.

    python -m bench.bench_e2e --quick                 # CPU: a small llama, a few minutes
    python -m bench.bench_e2e                         # CPU: longer prompts, more turns
    python -m bench.bench_e2e --shape llama3-8b --out cuda   # the H200: Llama-3-8B shape

The workload, the same for both servers (random weights: time does not depend
on their values): agent sessions sharing one long system prompt (tools and
rules), each turn adding a tool result; chats, each with a document of its own,
turn after turn.  Sessions take turns round-robin, more of them than
``--prompt-cache-size`` holds, so a returning session has often been evicted
from mlx-lm's memory.  Then both servers restart and every session returns
once more.  Both servers run side by side and get each request in turn (the
first to be asked alternates), so a shared machine's load falls on both alike;
requests are one at a time, streamed, ``max_tokens`` 8, temperature 0.  Each
server's first request after a start (a short one) compiles its kernels and is
not timed; after the sessions, two documents no server has seen measure a miss.

Reported per server: time from start to ``/health`` (persist compiles its
restore kernels before it listens), TTFT p50/p90 and mean per phase (first
contact, returning after eviction, after the restart, miss), tokens generated
per second of request time, and the cached prompt tokens the answers report.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import LLAMA3_8B, SMALL_LLAMA, machine, write_results
from bench.servers import Server
from persist.apps.demo import make_model

# its long context too: an 8k-token system prompt with the model's own rope
LLAMA3_8B_SERVED = {**LLAMA3_8B, "rope_theta": 500000.0, "max_position_embeddings": 131072}
SHAPES = {"small": SMALL_LLAMA, "llama3-8b": LLAMA3_8B_SERVED}


@dataclass
class Session:
    """One conversation: its fixed opening and the turns sent so far."""

    name: str
    opening: list[dict[str, str]]
    turns: list[dict[str, str]] = field(default_factory=list)

    def next_request(self, i: int) -> list[dict[str, str]]:
        if self.turns:  # the client sends back a reply and its next message
            self.turns.append({"role": "assistant", "content": f"Step {i} done."})
        self.turns.append({"role": "user", "content": f"{self.name} turn {i}: go on."})
        return [*self.opening, *self.turns]


def workload(system_words: int, doc_words: int, agents: int, chats: int) -> list[Session]:
    tools = " ".join(f"tool{i}(x) returns rule {i % 31} for x." for i in range(system_words // 8))
    system = f"You are an agent. Tools: {tools}"
    out = [
        Session(f"agent{a}", [{"role": "system", "content": system},
                              {"role": "user", "content": f"Task {a}: sort the files."}])
        for a in range(agents)
    ]  # fmt: skip
    for c in range(chats):
        doc = " ".join(f"line {j} of doc {c} says {j * 7 % 101}." for j in range(doc_words // 7))
        out.append(Session(f"chat{c}", [{"role": "user", "content": f"Read this: {doc}"}]))
    return out


def unseen(seed: str, chars: int) -> list[dict[str, str]]:
    """A document as long as a chat's, shared with nothing sent before: a miss."""
    words = " ".join(f"{seed} fact {j} is {j * 13 % 97}." for j in range(chars // 12 + 1))
    return [{"role": "user", "content": f"Summarize: {words[:chars]}"}]


def streamed(port: int, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: TTFT, tokens, the cached prompt tokens reported."""
    body = json.dumps({
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    })  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, tokens, cached, prompt = None, 0, 0, 0
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            tokens += 1
            first = time.perf_counter() - t0 if first is None else first
        usage = chunk.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached) or 0
        prompt = usage.get("prompt_tokens", prompt) or 0
    total = time.perf_counter() - t0
    conn.close()
    return {"ttft": first if first is not None else total, "total": total,
            "tokens": tokens, "cached": cached, "prompt": prompt}  # fmt: skip


def start(kind: str, model: Path, tmp: Path, cache_size: int) -> tuple[Server, float]:
    t0 = time.perf_counter()
    if kind == "plain":
        args = ["mlx_lm.server", "--model", str(model)]
    else:
        args = ["persist", "serve", "--model", str(model), "--store", str(tmp / "store")]
        # a variant's options, e.g. E2E_PERSIST_ARGS="--host-cache 0" (bench/cuda_restore_run.sh)
        args += os.environ.get("E2E_PERSIST_ARGS", "").split()
    srv = Server([*args, "--prompt-cache-size", str(cache_size)], tmp / f"{kind}.log")
    return srv, time.perf_counter() - t0


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = sorted(r["ttft"] for r in rows)
    busy = sum(r["total"] for r in rows)

    def q(p: float) -> float:
        return ttft[min(len(ttft) - 1, int(p * len(ttft)))]

    return {
        "requests": len(rows), "ttft_p50": statistics.median(ttft), "ttft_p90": q(0.9),
        "ttft_mean": statistics.fmean(ttft), "tokens_per_s": sum(r["tokens"] for r in rows) / busy,
        "cached_tokens": sum(r["cached"] for r in rows),
        "prompt_tokens": sum(r["prompt"] for r in rows),
    }  # fmt: skip


def scrape(port: int) -> str:
    """persist serve's /metrics (where its request time went: lookup, restore, keep)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return "\n".join(line for line in text.splitlines() if line.startswith("persist_"))


# Both servers share one GPU: a request sent the moment the other server answered
# ran beside that server's tail (its last decode step, its insert), persist's more
# often (plain waits for persist's write-behind; on an H100 a miss then cost 1.20x
# plain's where persist was asked second, 1.08x where first).  Neither server's own
# background work is waited for but by ``quiet``.
SETTLE_S = 0.2


def quiet(port: int, bound: float = 60.0) -> float:
    """Wait until persist serve's write-behind has nothing queued or in writing (at most
    ``bound`` seconds); the seconds waited.  Both servers share one machine (one GPU):
    plain's request is asked only once persist's own background work is done, so
    that only persist's requests pay for it, as they would on a machine of their own."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound:
        m = re.search(r"^persist_write_queue_depth (\S+)$", scrape(port), re.M)
        if m is None or float(m.group(1)) == 0:
            break
        time.sleep(0.05)
    return time.monotonic() - t0


def stats_into(store: Path, out: Path) -> None:
    """``persist stats`` of persist's store into ``out``: its restore-or-recompute
    decisions and the rates they used (why a hit was taken or declined)."""
    # ``python -m``: the GPU machine installs persist by PYTHONPATH, no ``persist`` on PATH
    command = [sys.executable, "-m", "persist", "stats", "--store", str(store)]
    got = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    out.write_text(got.stdout + got.stderr)


def profilers(
    servers: dict[str, Server], logs: Path | None, life: str
) -> list[subprocess.Popen[bytes]]:
    """py-spy sampling each server's threads (E2E_PYSPY: its path), into ``logs``: both
    servers, so that the sampling costs each the same."""
    spy = os.environ.get("E2E_PYSPY")
    if not spy or logs is None:
        return []
    at = life.replace(" ", "-")
    return [sampling(spy, srv, logs / f"pyspy-{k}-{at}.txt") for k, srv in servers.items()]


def sampling(
    spy: str, srv: Server, out: Path, *more: str, rate: int = 200
) -> subprocess.Popen[bytes]:
    """py-spy recording ``srv``'s threads into ``out`` (raw; ``more``: e.g. ``--gil``)
    until it gets SIGINT."""
    args = [spy, "record", "--pid", str(srv.proc.pid), "--format", "raw", "-o", str(out),
            "--threads", "--nonblocking", "--rate", str(rate), *more]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(model: Path, tmp: Path, sessions: list[Session], rounds: int, cache_size: int,
        max_tokens: int, logs: Path | None = None, misses: int = 4,
        settle: float = SETTLE_S) -> dict[str, Any]:  # fmt: skip
    kinds = ["plain", "persist"]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {k: {} for k in kinds}
    starts: dict[str, list[float]] = {k: [] for k in kinds}
    n = 0

    def ask(servers: dict[str, Server], phase: str, messages: list[dict[str, str]]) -> None:
        nonlocal n
        order = kinds if n % 2 == 0 else kinds[::-1]
        n += 1
        for k in order:
            waited = quiet(servers["persist"].port) if k == "plain" else 0.0
            time.sleep(settle)  # the other server's tail (its last step, its insert) is over
            row = {**streamed(servers[k].port, messages, max_tokens), "waited": waited}
            rows[k].setdefault(phase, []).append(row)
            if logs is not None:  # every request, to read where time went
                with (logs / "requests.jsonl").open("a") as f:
                    f.write(json.dumps({"server": k, "phase": phase, **row}) + "\n")

    for life in ("before restart", "after restart"):
        servers = {}
        for k in kinds:
            servers[k], took = start(k, model, tmp, cache_size)
            starts[k].append(took)
        spies = profilers(servers, logs, life)
        try:
            for k in kinds:  # each server's first request compiles its kernels: not timed
                streamed(servers[k].port, [{"role": "user", "content": f"warm up {life}"}], 2)
            for r in range(rounds if life == "before restart" else 1):
                for s in sessions:
                    phase = life if life == "after restart" else (
                        "first contact" if r == 0 else "returning")  # fmt: skip
                    ask(servers, phase, s.next_request(len(s.turns)))
            for j in range(misses):  # prompts no server has seen: what a miss costs
                ask(servers, "miss", unseen(f"{life} {j}", len(sessions[-1].opening[0]["content"])))
        finally:
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            if logs is not None:
                (logs / f"metrics-{life.replace(' ', '-')}.txt").write_text(
                    scrape(servers["persist"].port)
                )
                stats_into(tmp / "store", logs / f"stats-{life.replace(' ', '-')}.txt")
            for srv in servers.values():
                srv.stop()
    out: dict[str, Any] = {}
    for k in kinds:
        every = [row for phase in rows[k].values() for row in phase]
        out[k] = {"start_s": starts[k], "all": summary(every),
                  **{p: summary(v) for p, v in rows[k].items()}}  # fmt: skip
    for p, mine in rows["persist"].items():  # ask sends each request to both servers
        theirs = rows["plain"][p]
        out["persist"][p]["pair_ratios"] = [
            a["ttft"] / b["ttft"] for a, b in zip(mine, theirs, strict=True) if b["ttft"] > 0
        ]
    return out


def render(res: dict[str, Any], setup: str) -> str:
    lines = [
        "# persist serve against plain mlx_lm.server, end to end", "", setup, "",
        "| phase | server | requests | TTFT p50 s | TTFT p90 s | TTFT mean s | tokens/s | "
        "prompt tokens | cached tokens |", "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    phases = [p for p in res["plain"] if p not in ("start_s",)]
    for p in phases:
        for k in ("plain", "persist"):
            s = res[k][p]
            name = "plain mlx_lm.server" if k == "plain" else "persist serve"
            lines.append(
                f"| {p} | {name} | {s['requests']} | {s['ttft_p50']:.3f} | {s['ttft_p90']:.3f} "
                f"| {s['ttft_mean']:.3f} | {s['tokens_per_s']:.1f} | {s['prompt_tokens']} "
                f"| {s['cached_tokens']} |"
            )
    lines += ["", "Start to /health, seconds (each start):", ""]
    for k in ("plain", "persist"):
        lines.append(f"- {k}: " + ", ".join(f"{t:.1f}" for t in res[k]["start_s"]))
    for p in phases:
        a, b = res["plain"][p]["ttft_mean"], res["persist"][p]["ttft_mean"]
        c, d = res["plain"][p]["ttft_p50"], res["persist"][p]["ttft_p50"]
        lines.append(f"- {p}: persist's mean TTFT is {b / a:.2f}x plain's (median {d / c:.2f}x)")
    for p in phases:  # each request was sent to both: its own ratio, less noisy
        r = res["persist"][p].get("pair_ratios") or []
        if r:
            lines.append(
                f"- {p}: persist over plain, request by request: median "
                f"{statistics.median(r):.2f}x of {len(r)} ({min(r):.2f}x-{max(r):.2f}x)"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--model", type=Path, help="an existing model folder (skip making one)")
    ap.add_argument("--out", default="cpu", help="results name: bench/results/e2e-OUT.*")
    ap.add_argument("--system-words", type=int)
    ap.add_argument("--logs", type=Path, help="keep every request, persist's /metrics, logs")
    ap.add_argument("--misses", type=int, default=4, help="unseen documents in each life")
    args = ap.parse_args()
    words = args.system_words or (500 if args.quick else 1200)
    agents, chats, rounds = (2, 2, 2) if args.quick else (3, 3, 3)
    cache_size = 2  # fewer than the sessions: returning ones were often evicted
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        model = args.model or make_model(tmp / "model", "llama", overrides=SHAPES[args.shape])
        sessions = workload(words, words // 2, agents, chats)
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
        try:
            res = run(model, tmp, sessions, rounds, cache_size, max_tokens=8, logs=args.logs,
                      misses=args.misses)  # fmt: skip
        finally:
            if args.logs is not None:  # the servers' own logs (timings, warnings)
                for log in tmp.glob("*.log"):
                    (args.logs / log.name).write_bytes(log.read_bytes())
    setup = (
        f"`python -m bench.bench_e2e{' --quick' if args.quick else ''} --shape {args.shape}` on "
        f"{machine()}: llama ({args.shape}) random weights, {agents} agent sessions sharing one "
        f"long system prompt and {chats} chats each with a document of its own (prompt "
        f"tokens in the table; byte-level tokenizer), {rounds} round-robin turns each with "
        f"`--prompt-cache-size {cache_size}`, then both servers restart and each session "
        f"returns once, then {args.misses} unseen documents (a miss) in each life; each "
        "server's first "
        "request after a start (short) is not timed; requests one at a time, streamed, "
        "max_tokens 8; both servers side by "
        "side, each request sent to both (the first asked alternates), plain's only once "
        "persist's write-behind is idle (persist's background work slows only its own "
        f"requests), each {SETTLE_S} s after the previous answer (the other server's tail)."
    )
    write_results(f"e2e-{args.out}", res, render(res, setup))
    print(render(res, setup))


if __name__ == "__main__":
    main()
