"""Cuts mlx-lm's prompt cache makes in persist serve's memory tier: it cuts a
longer cached prompt with ``trim_prompt_cache``, each cache class's own trim.

- kv_bits: a QuantizedKVCache stays quantized at any length, but a fresh run
  of fewer than ``quantized_kv_start`` tokens is still plain, so such a cut is
  a state no fresh prefill gives: the memory tier refuses it (persist.servable)
  and asks its other tiers.
- ConcatenateKVCache's trim only lowers its offset and keeps the cut positions,
  which the next call appends after: the memory tier hands out persist's own
  cut of it instead.

Both found by the state-space search (tests/search)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ConcatenateKVCache, QuantizedKVCache

import persist
from persist.serve.server import PersistentPromptCache
from tests.helpers import kv_quantized, prefill, raw, tokens_for

START = 24


def test_the_memory_tier_never_hands_out_a_quantized_cut_below_the_start(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama_hd64")
    ident = persist.ModelIdentity.of(
        model, tok, kv_bits=4, kv_group_size=32, quantized_kv_start=START
    )
    toks = tokens_for(40, seed=3)
    cache = kv_quantized(model, toks, START)  # plain, then quantized as mlx-lm does
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            pc.insert_cache("m", toks, cache)
            pc.flush()
            got, _ = pc.fetch_nearest_cache("m", [*toks[:10], (toks[10] + 1) % 256, 7])
        finally:
            pc.close()
    # a fresh run of the 10 shared tokens holds plain KV caches: no quantized hit
    assert got is None or not any(isinstance(c, QuantizedKVCache) for c in got)


def test_the_memory_tier_never_hands_out_positions_a_cut_only_hid(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(30, seed=4)
    cache, _ = prefill(model, toks, [ConcatenateKVCache() for _ in model.layers])
    prompt = [*toks[:12], (toks[12] + 1) % 256, 7]
    with persist.Store(tmp_path / "s") as store:
        pc = PersistentPromptCache(4, store=store, identity=ident)
        try:
            pc.insert_cache("m", toks, cache)
            pc.flush()
            got, rest = pc.fetch_nearest_cache("m", prompt)
        finally:
            pc.close()
    assert got is not None
    k = len(prompt) - len(rest)
    want, _ = prefill(model, toks[:k], [ConcatenateKVCache() for _ in model.layers])
    for t in rest:  # the rest of the prompt, as the server feeds it
        a, b = model(mx.array([[t]]), cache=got)[0, -1], model(mx.array([[t]]), cache=want)[0, -1]
        assert raw(a) == raw(b)
