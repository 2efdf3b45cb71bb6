"""Checkpoints for a hybrid model (gated-DeltaNet + attention, e.g. Qwen3-Next): its
recurrent state cannot be trimmed, so a later prompt resumes only where a snapshot
was taken.  Prime a document with a checkpoint every 128 tokens, then ask two
questions about it: each reuses the deepest checkpoint inside the shared prefix.

    python examples/hybrid_checkpoints.py --model ./my-qwen3-next --store ./cache
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm import load

import persist

DOCUMENT = " ".join(f"Section {i}: the pump runs at setting {i % 7}." for i in range(40))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--store", required=True)
    args = ap.parse_args()
    model, tokenizer = load(args.model)[:2]
    identity = persist.ModelIdentity.of(model, tokenizer)
    doc = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    with persist.Store(args.store) as store:
        persist.prefill(
            model, doc, store=store, identity=identity, session="manual", checkpoint_every=128
        )
        print(f"document: {len(doc)} tokens, {len(store.entries()) - 0} entries stored")
        for question in (" What does section 3 say?", " Which setting is highest?"):
            prompt = doc + tokenizer.encode(question, add_special_tokens=False)
            hit = store.lookup(prompt, identity=identity)
            assert hit is not None
            logits = model(mx.array([prompt[len(hit.tokens) :]]), cache=hit.cache)
            mx.eval(logits)
            print(f"question reused {len(hit.tokens)} of {len(prompt)} tokens")


if __name__ == "__main__":
    main()
