"""An agent under a burst of one-off prompts, with and without retention hints.

The agent sends a long system prompt with its tools and one question per turn;
between its turns come one-off prompts (documents nobody sends twice) that
overflow the cache's budget.  Two places the budget bites, a fresh server and
store for each:

- ``store``: the store's budget (``--max-bytes``) holds the agent's entry and
  one and a half one-offs; no host tier, mlx-lm's memory holds one entry;
- ``host``: the host tier's budget (``--host-cache``) holds as much; the store
  is unbounded, so a host miss is read from disk.

Each with ``hints`` (the system message carries ``cache_control`` with a 1-hour
ttl) and without.  Reported: the agent prefix's hit rate over the agent's turns
after its first (a turn hits when its cached tokens cover the system prompt),
the mean time to the first token (``max_tokens`` 1) of those turns and of the
one-offs, where the hits came from, and the misses by reason
(``persist_misses_total``).  A llama-shaped random-weight model (no download).

    python -m bench.bench_hints --quick    # results in bench/results/hints.*
    python -m bench.bench_hints            # longer prompts, more turns
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

from bench.common import machine, write_results
from bench.servers import Server

# small enough that a 2-core machine runs the whole benchmark in minutes
MID_LLAMA = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "intermediate_size": 704,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} an order by its number",
            "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}},
        },
    }
    for name in ("lookup", "refund", "reship", "cancel")
]


def agent_system(chars: int) -> str:
    tools = "; ".join(f"{t['function']['name']}(order)" for t in TOOLS)
    rules = " ".join(f"Rule {i}: answer order question {i % 13} politely." for i in range(400))
    return f"You are the order agent. Tools: {tools}. " + rules[:chars]


def agent_turn(system: str, turn: int, hinted: bool) -> list[dict[str, Any]]:
    sys_msg: dict[str, Any] = {"role": "system", "content": system}
    if hinted:
        sys_msg["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    return [sys_msg, {"role": "user", "content": f"Where is order {100 + turn}?"}]


def one_off(i: int, chars: int) -> list[dict[str, Any]]:
    text = " ".join(f"Line {i}.{k}: item {k} costs {k * i % 97}." for k in range(chars // 20))
    return [{"role": "user", "content": f"Summarize document {i}: {text[:chars]}"}]


def ask(srv: Server, messages: list[dict[str, Any]], tools: bool) -> tuple[float, int, int]:
    """(seconds to the one token, prompt tokens, cached tokens)."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
    if tools:
        body["tools"] = TOOLS
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/chat/completions", data=json.dumps(body).encode()
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        usage = json.loads(r.read())["usage"]
    took = time.perf_counter() - t0
    return took, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def sizes(model_dir: Path, messages: list[list[dict[str, Any]]], tmp: Path) -> list[int]:
    """Bytes of each prompt's cache in a store: about what the server's caches of them
    hold in RAM too (measured: within 3%), so both budgets are sized by them."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    import persist

    model, tok = load(str(model_dir))
    identity = persist.ModelIdentity.of(model, tok)
    out = []
    with persist.Store(tmp / "probe") as probe:
        for i, m in enumerate(messages):
            tools = TOOLS if m[0]["role"] == "system" else None  # the agent's turns only
            toks = list(tok.apply_chat_template(m, tools=tools, add_generation_prompt=True))
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([toks]), cache=cache))
            saved = probe.save(cache, toks, identity=identity, session=f"p{i}")
            out.append(int(saved.bytes))
    return out


def counted(srv: Server) -> dict[str, dict[str, int]]:
    """Hits by source and misses by reason, as /metrics gives them (nonzero only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=60) as r:
        text = r.read().decode()
    out: dict[str, dict[str, int]] = {"hits": {}, "misses": {}}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        labels = dict(p.split("=") for p in name.partition("{")[2].rstrip("}").split(",") if p)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if name.startswith("persist_cache_lookups_total{") and labels.get("result") == "hit":
            out["hits"][labels["source"]] = int(float(value))
        elif name.startswith("persist_misses_total{") and float(value):
            out["misses"][labels["reason"]] = int(float(value))
    return out


def run(
    place: str, hinted: bool, model: Path, tmp: Path, budget: int, work: dict[str, Any]
) -> dict[str, Any]:
    store = tmp / f"{place}-{hinted}"
    args = ["persist", "serve", "--model", str(model), "--store", str(store)]
    args += ["--prompt-cache-size", "1"]
    if place == "store":
        args += ["--max-bytes", str(budget), "--host-cache", "0"]
    else:
        args += ["--host-cache", str(budget)]
    srv = Server(args, tmp / f"{place}-{hinted}.log")
    agent_t: list[float] = []
    once_t: list[float] = []
    hits, sources = 0, dict[str, int]()
    try:
        ask(srv, [{"role": "user", "content": "warm up"}], False)
        for turn in range(work["turns"]):
            before = counted(srv)["hits"]
            t, _, c = ask(srv, agent_turn(work["system"], turn, hinted), True)
            if turn:  # the first turn has nothing to reuse
                agent_t.append(t)
                hits += c >= work["prefix"]
                after = counted(srv)["hits"]
                src = [k for k in ("host", "local") if after.get(k, 0) > before.get(k, 0)]
                where = src[0] if src and c >= work["prefix"] else "prefill"
                sources[where] = sources.get(where, 0) + 1
            for i in range(work["burst"]):
                once_t.append(ask(srv, one_off(turn * 100 + i, work["once_chars"]), False)[0])
        seen = counted(srv)
        host = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/health").read())
    finally:
        srv.stop()
    return {
        "agent_prefix_hit_rate": hits / (work["turns"] - 1),
        "agent_prefix_from": sources,
        "agent_ttft_s": statistics.mean(agent_t),
        "one_off_ttft_s": statistics.mean(once_t),
        "metrics": seen,
        "host_cache": host.get("host_cache"),
    }


def prefix_tokens(model: Path, system: str) -> int:
    """Tokens of the agent's prompt up to the end of its system message."""
    from mlx_lm import load

    _, tok = load(str(model))
    head = [{"role": "system", "content": system}]
    return len(tok.apply_chat_template(head, tools=TOOLS, add_generation_prompt=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    work: dict[str, Any] = {
        "turns": 4 if args.quick else 8,
        "burst": 3 if args.quick else 5,
        "system_chars": 1500 if args.quick else 4000,
        "once_chars": 800 if args.quick else 2000,
    }
    work["system"] = agent_system(work["system_chars"])
    results: dict[str, Any] = {"machine": machine(), "model": MID_LLAMA, "runs": {}}
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        from persist.apps.demo import make_model

        model = make_model(tmp / "model", "llama", overrides=MID_LLAMA)
        work["prefix"] = prefix_tokens(model, work["system"])
        agent, once = sizes(
            model, [agent_turn(work["system"], 0, False), one_off(0, work["once_chars"])], tmp
        )
        budgets = {"store": agent + once * 3 // 2, "host": agent + once * 3 // 2}
        for place in ("store", "host"):
            for hinted in (False, True):
                key = f"{place}, {'hints' if hinted else 'no hints'}"
                results["runs"][key] = run(place, hinted, model, tmp, budgets[place], work)
                print(key, results["runs"][key], flush=True)
    results["workload"] = {k: v for k, v in work.items() if k != "system"}
    results["budgets"] = budgets
    results["quick"] = args.quick
    write_results("hints", results, report(results))
    print(report(results))


def report(results: dict[str, Any]) -> str:
    w, m = results["workload"], results["model"]
    lines = [
        "# An agent under bursts of one-off prompts, with and without retention hints",
        "",
        f"{w['turns']} agent turns (a {w['prefix']}-token system prompt with tools, one question "
        f"each), {w['burst']} one-off prompts of about {w['once_chars']} characters after each; "
        f"budgets hold the agent's entry and one and a half one-offs "
        f"(store {results['budgets']['store']} B, host tier {results['budgets']['host']} B). "
        f"llama-shaped random-weight model ({m['num_hidden_layers']} layers, hidden "
        f"{m['hidden_size']}), {results['machine']['platform']}, {results['machine']['cpus']} "
        "CPUs.  TTFT: a request with max_tokens 1; hits over turns 2..N.",
        "",
        "| budget | hints | agent prefix hit rate | agent prefix from | agent TTFT (s) "
        "| one-off TTFT (s) |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results["runs"].items():
        place, hints = key.split(", ")
        src = ", ".join(f"{k} {v}" for k, v in sorted(r["agent_prefix_from"].items()))
        lines.append(
            f"| {place} | {hints} | {r['agent_prefix_hit_rate']:.2f} | {src} "
            f"| {r['agent_ttft_s']:.3f} | {r['one_off_ttft_s']:.3f} |"
        )
    lines += ["", "Hits by source and misses by reason (/metrics), every request counted:", ""]
    for key, r in results["runs"].items():
        hits = ", ".join(f"{k} {v}" for k, v in r["metrics"]["hits"].items())
        why = ", ".join(f"{k} {v}" for k, v in r["metrics"]["misses"].items()) or "none"
        lines.append(f"- {key}: hits {hits}; misses {why}")
    lines += [
        "",
        "A hit is any reuse (mlx-lm's memory reuses a chat template's first tokens for every "
        "prompt); a miss is a lookup that reused less than the prompt shares with the store, "
        "by `persist explain`'s reason.  With the store's budget, the one-offs evict the "
        "unhinted agent entry first (least recently used) and every agent turn prefills its "
        "system prompt again; with the 1-hour mark it is evicted last and every turn restores "
        "it.  With the host tier's budget the store is unbounded, so the agent's prefix comes "
        "back either way; the mark decides whether from RAM (host) or from disk (local), "
        'which is the column "agent prefix from" (the tier whose hit counter moved during '
        "the turn; prefill: not restored).  Measured on a 2-core VM shared with other "
        "engineers' test runs: seconds are noisy, the hit rates and sources are not.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
