"""The loop a server runs per request: reuse the longest stored prefix of the prompt,
compute the rest, store the prompt's cache for the next request that shares it.

    python examples/server_loop.py --model ./my-model --store ./cache
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import persist

SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. " * 4
REQUESTS = [SYSTEM + "How do I reset it?", SYSTEM + "Where is the fuse?", SYSTEM + "Thanks!"]


def serve_one(model, tokenizer, store: persist.Store, identity, prompt: str) -> int:  # type: ignore[no-untyped-def]
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    hit = store.lookup(tokens, identity=identity, namespace="tenant-a")
    cache = hit.cache if hit else make_prompt_cache(model)
    reused = len(hit.tokens) if hit else 0
    logits = model(mx.array([tokens[reused:]]), cache=cache)  # prefill only what is new
    mx.eval(logits)
    store.save(cache, tokens, identity=identity, namespace="tenant-a")  # an anonymous prefix
    return reused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    args = ap.parse_args()
    model, tokenizer = load(args.model)[:2]
    identity = persist.ModelIdentity.of(model, tokenizer)
    with persist.Store(args.store, max_bytes=1 << 30) as store:
        for i, prompt in enumerate(REQUESTS):
            print(
                f"request {i}: {serve_one(model, tokenizer, store, identity, prompt)} tokens reused"
            )
        print(store.stats("tenant-a").counters)


if __name__ == "__main__":
    main()
