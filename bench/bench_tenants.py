"""A multi-tenant agent workload: N tenants share a ~2k-token public system prompt.

Each tenant sends two turns (a question, then a follow-up) with the same
system prompt, the tenants one after another.  Three servers, each fresh
on an empty store:

- ``one namespace``: single-tenant, as before issue 37: everyone reuses
  everyone's cache (and can read everyone's prompts through it);
- ``no sharing``: ``--api-keys``, no public prefix: each tenant prefills the
  system prompt on its first turn;
- ``public prefix``: ``--api-keys --public-prefix``: the system prompt is
  prefilled once, by the first tenant, and resumed by every other.

Reported per mode: the fraction of prompt tokens served from a cache, and
the mean time to the first token (``max_tokens`` 1) of first turns and of
follow-ups.  A llama-shaped model with random weights (no download).

    python -m bench.bench_tenants            # results in bench/results/tenants.*
    python -m bench.bench_tenants --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import SMALL_LLAMA, machine, write_results
from bench.servers import Server
from persist.apps.demo import make_model

MODES = ("one namespace", "no sharing", "public prefix")


def system_prompt(tokens: int) -> str:
    """About ``tokens`` tokens with the byte-level tokenizer: the agent's rules and tools."""
    rules = " ".join(f"Rule {i}: answer order question {i % 13} politely." for i in range(400))
    return rules[:tokens]


def ask(srv: Server, messages: list[dict[str, str]], key: str | None) -> tuple[float, int, int]:
    """One request: (seconds to its one token, prompt tokens, cached tokens)."""
    body = json.dumps({"messages": messages, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/chat/completions", data=body, headers=headers
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        usage = json.loads(r.read())["usage"]
    took = time.perf_counter() - t0
    return took, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def run_mode(mode: str, model: Path, tmp: Path, system: str, tenants: int) -> dict[str, Any]:
    keys = {f"tenant{i}": f"key-of-tenant-{i:04d}-0123456789" for i in range(tenants)}
    (tmp / "keys").write_text("".join(f"{k} {t}\n" for t, k in keys.items()))
    public = tmp / "public.json"
    public.write_text(json.dumps([{"messages": [{"role": "system", "content": system}]}]))
    args = ["persist", "serve", "--model", str(model), "--store", str(tmp / mode)]
    if mode != "one namespace":
        args += ["--api-keys", str(tmp / "keys")]
    if mode == "public prefix":
        args += ["--public-prefix", str(public)]
    srv = Server(args, tmp / f"{mode}.log")
    first: list[float] = []
    follow: list[float] = []
    prompt = cached = 0
    try:
        ask(srv, [{"role": "user", "content": "warm up"}], next(iter(keys.values())))
        for i, (tenant, key) in enumerate(keys.items()):
            turn = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"I am {tenant}; where is my order {i}?"},
            ]
            t, p, c = ask(srv, turn, key if mode != "one namespace" else None)
            first.append(t)
            prompt, cached = prompt + p, cached + c
            turn += [
                {"role": "assistant", "content": "It ships tomorrow."},
                {"role": "user", "content": "And the invoice?"},
            ]
            t, p, c = ask(srv, turn, key if mode != "one namespace" else None)
            follow.append(t)
            prompt, cached = prompt + p, cached + c
    finally:
        srv.stop()
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt,
        "first_turn_ttft_s": statistics.mean(first),
        "first_turn_ttft_s_after_the_first_tenant": statistics.mean(first[1:]),
        "follow_up_ttft_s": statistics.mean(follow),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tenants", type=int, default=8)
    args = ap.parse_args()
    tenants = 3 if args.quick else args.tenants
    system = system_prompt(600 if args.quick else 2048)
    results: dict[str, Any] = {"machine": machine(), "tenants": tenants, "modes": {}}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        model = make_model(tmp / "model", "llama", overrides=SMALL_LLAMA)
        for mode in MODES:
            results["modes"][mode] = run_mode(mode, model, tmp, system, tenants)
    results["system_prompt_chars"] = len(system)
    lines = [
        f"# {tenants} tenants sharing a {len(system)}-token public system prompt",
        "",
        "Two turns per tenant, tenants one after another, a fresh server and store per mode;",
        f"llama-shaped random-weight model ({SMALL_LLAMA['num_hidden_layers']} layers, hidden "
        f"{SMALL_LLAMA['hidden_size']}), {results['machine']['platform']}, "
        f"{results['machine']['cpus']} CPUs.  TTFT: a request with max_tokens 1.",
        "",
        "| mode | cached fraction | first turn TTFT (s) | first turn, tenants 2..N (s) "
        "| follow-up TTFT (s) |",
        "|---|---|---|---|---|",
    ]
    for mode, r in results["modes"].items():
        lines.append(
            f"| {mode} | {r['cached_fraction']:.3f} | {r['first_turn_ttft_s']:.3f} | "
            f"{r['first_turn_ttft_s_after_the_first_tenant']:.3f} | {r['follow_up_ttft_s']:.3f} |"
        )
    lines += [
        "",
        "`one namespace` shares everything, prompts included (the issue-37 oracle); `no "
        "sharing` keeps tenants apart and prefills the system prompt once per tenant; "
        "`public prefix` keeps tenants apart and prefills it once for all.",
        "",
    ]
    name = "tenants-quick" if args.quick else "tenants"
    write_results(name, results, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
