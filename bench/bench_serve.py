"""Time to first token after a server restart, with and without persist.

A llama-shaped model with random weights (no download), a conversation of
about 4k tokens; the second request after a restart is timed against a
plain ``mlx_lm.server`` that must prefill everything again.

    python -m bench.bench_serve            # results in bench/results/serve.*
    python -m bench.bench_serve --quick
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import SMALL_LLAMA, machine, write_results
from bench.servers import Server
from persist.apps.demo import make_model


def conversation(words: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    system = " ".join(f"fact{i % 97} is {i}." for i in range(words // 3))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
    second = [
        *first,
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "And the next?"},
    ]
    return first, second


def timed(server: Server, messages: list[dict[str, str]]) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    resp = server.chat(messages, max_tokens=1)
    return time.perf_counter() - t0, resp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    words = 300 if args.quick else 820  # about 4k tokens with the byte-level tokenizer
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as d:
        tmp = Path(d)
        model = make_model(
            tmp / "model",
            "llama",
            overrides=SMALL_LLAMA,
        )
        first, second = conversation(words)
        plain = Server(["mlx_lm.server", "--model", str(model)], tmp / "plain.log")
        try:
            without, plain_resp = timed(plain, second)
        finally:
            plain.stop()
        warmup = Server(
            ["persist", "serve", "--model", str(model), "--store", str(tmp / "store")],
            tmp / "a.log",
        )
        try:
            warmup.chat(first, max_tokens=1)
        finally:
            warmup.stop()
        restarted = Server(
            ["persist", "serve", "--model", str(model), "--store", str(tmp / "store")],
            tmp / "b.log",
        )
        try:
            with_persist, resp = timed(restarted, second)
        finally:
            restarted.stop()
    r = {
        "machine": machine(),
        "prompt_tokens": resp["usage"]["prompt_tokens"],
        "cached_tokens": resp["usage"]["prompt_tokens_details"]["cached_tokens"],
        "without_persist_s": without,
        "with_persist_s": with_persist,
        "speedup": without / with_persist,
        "same_token": resp["choices"][0]["message"]["content"]
        == plain_resp["choices"][0]["message"]["content"],
    }
    md = (
        "# Server restart benchmark\n\n"
        f"A 24M-parameter llama-shaped model (random weights), a {r['prompt_tokens']}-token "
        "conversation. Time for the second request after a server restart (max_tokens=1, "
        f"so about the time to first token): plain mlx_lm.server {without:.2f} s; "
        f"persist serve {with_persist:.3f} s with {r['cached_tokens']} prompt tokens from the "
        f"store: **{r['speedup']:.0f}x**; same first token: {r['same_token']}.\n"
    )
    write_results("serve-quick" if args.quick else "serve", r, md)
    print(md)


if __name__ == "__main__":
    main()
