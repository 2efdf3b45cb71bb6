"""persist serve's memory tier and kv_bits: mlx-lm's prompt cache cuts a longer
cached prompt with ``trim_prompt_cache``, which keeps a QuantizedKVCache
quantized at any length.  A fresh run of fewer than ``quantized_kv_start``
tokens is still plain, so such a cut is a state no fresh prefill gives: the
memory tier refuses it (persist.servable) and asks its other tiers.  Found by
the state-space search (tests/search)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.models.cache import QuantizedKVCache

import persist
from persist.serve.server import PersistentPromptCache
from tests.helpers import kv_quantized, tokens_for

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
