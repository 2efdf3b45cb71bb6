"""Differential trims: lookup-trim-continue equals prefill-of-prefix-continue, bit for bit.

A prefix hit hands out a stored cache cut to the shared prefix.  It must hold
exactly what a fresh prefill of that prefix holds (no positions of the longer
session it came from) and continue exactly like it, for every cache class.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import persist
from tests.helpers import (
    assert_same_state,
    kv_quantized,
    live_state,
    prefill,
    raw,
    tokens_for,
)
from tests.trim_checks import assert_continues_alike, diverging, hit_equals_prefill


@pytest.mark.parametrize("shared", [16, 40, 200, 255, 300])
def test_kv_prefix_hits_of_any_length(shared: int, tiny: Any, store: persist.Store) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    stored, prompt = diverging(shared, 600 if shared < 300 else 1000, shared + 30)
    hit_equals_prefill(
        store, model, identity, lambda t: prefill(model, t)[0], stored, prompt, shared
    )


def test_concatenate_kv_trim_drops_the_cut_positions(tiny: Any, store: persist.Store) -> None:
    """mlx-lm's ConcatenateKVCache.trim keeps the arrays; the hit must not."""
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok, max_kv_size=0)

    def build(t: list[int]) -> list[Any]:
        cache = [C.ConcatenateKVCache() for _ in model.layers]
        return prefill(model, t, cache=cache)[0]

    stored, prompt = diverging(300, 400, 340)
    hit_equals_prefill(store, model, identity, build, stored, prompt, 300)
    hit = store.lookup(prompt, identity=identity)
    assert hit is not None
    assert all(c.keys.shape[2] == 300 for c in hit.cache)


def test_unwrapped_ring_hit(tiny: Any, store: persist.Store) -> None:
    """A 20-token hit into a 29-token gemma3 ring that has not wrapped (window 32)."""
    model, tok, _ = tiny("gemma3")
    identity = persist.ModelIdentity.of(model, tok)
    stored, prompt = diverging(20, 29, 26)
    hit_equals_prefill(store, model, identity, lambda t: prefill(model, t)[0], stored, prompt, 20)


def test_quantized_kv_hit_above_its_floor(tiny: Any, store: persist.Store) -> None:
    model, tok, _ = tiny("llama_hd64")
    identity = persist.ModelIdentity.of(
        model, tok, kv_bits=4, kv_group_size=32, quantized_kv_start=64
    )

    def build(t: list[int]) -> list[Any]:
        return kv_quantized(model, t, 64, 4, 32)

    stored, prompt = diverging(200, 300, 230)
    cache = build(stored)
    for c in cache:  # the conversion point, as a caller that knows it records it
        c.min_resume_offset = 150
    store.save(cache, stored, identity=identity)
    hit = store.lookup(prompt, identity=identity)
    assert hit is not None
    floor = hit.entry.min_resume_offset
    assert floor == 150 and len(hit.tokens) == 200
    assert [persist.kind_of(c) for c in hit.cache] == ["quantized-kv"] * len(model.layers)
    # the reference: the stored session's own cache, cut by hand to the prefix
    want = build(stored)
    for c in want:
        c.keys = tuple(a[..., :200, :] for a in c.keys)
        c.values = tuple(a[..., :200, :] for a in c.values)
        c.offset = 200
        c.min_resume_offset = 150
    assert_continues_alike(model, hit.cache, want, prompt[200:])


def test_chunked_kv_hit(tiny: Any, store: persist.Store) -> None:
    model, tok, _ = tiny("llama4")
    identity = persist.ModelIdentity.of(model, tok)
    stored, prompt = diverging(100, 110, 120)
    hit_equals_prefill(
        store, model, identity, lambda t: prefill(model, t, step=16)[0], stored, prompt, 100
    )


# -- caches that no tiny model builds on its own: fed keys and values directly --


def feed(cache: Any, n: int, seed: int) -> Any:
    mx.random.seed(seed)
    k = mx.random.normal((1, 2, n, 8)).astype(mx.float16)
    v = mx.random.normal((1, 2, n, 8)).astype(mx.float16)
    return cache.update_and_fetch(k, v)


def direct_identity() -> persist.ModelIdentity:
    return persist.ModelIdentity("direct", "c", "w", "t", "ct")


def make_list() -> Any:
    return C.CacheList(C.KVCache(), C.ConcatenateKVCache())


def make_batch() -> Any:
    b = C.BatchKVCache([0])
    return b


def make_batch_ring() -> Any:
    return C.BatchRotatingKVCache(64, [0])


@pytest.mark.parametrize("make", [make_list, make_batch, make_batch_ring])
def test_direct_caches_trim_like_a_shorter_feed(make: Any, store: persist.Store) -> None:
    """Stored after 40 + 10 positions, hit at 40: equals a cache fed only the 40."""
    identity = direct_identity()
    toks = tokens_for(50, seed=3)
    stored = make()
    for c in [stored]:
        if isinstance(c, C.CacheList):
            for inner in c.caches:
                feed(inner, 40, 0)
                feed(inner, 10, 1)
        else:
            feed(c, 40, 0)
            feed(c, 10, 1)
    store.save([stored], toks, identity=identity)
    prompt = toks[:40] + [(toks[40] + 1) % 256, 5, 6]
    hit = store.lookup(prompt, identity=identity)
    assert hit is not None and len(hit.tokens) == 40
    want = make()
    parts = want.caches if isinstance(want, C.CacheList) else [want]
    for inner in parts:
        feed(inner, 40, 0)
    assert_same_state(live_state(hit.cache), live_state([want]))
    got_parts = hit.cache[0].caches if isinstance(want, C.CacheList) else [hit.cache[0]]
    for g, w in zip(got_parts, parts, strict=True):
        a, b = feed(g, 3, 9), feed(w, 3, 9)
        assert raw(a[0]) == raw(b[0]) and raw(a[1]) == raw(b[1])


# long: 8 s of prefill; tests/storage/test_scale.py finds each of 3,000 chats in the quick run
@pytest.mark.long
def test_a_chat_of_many_sharing_a_system_prompt_hits_its_own_session(
    tiny: Any, store: persist.Store
) -> None:
    """40 chats share a 100-token system prompt; continuing one of them hits that one."""
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    system = tokens_for(100, seed=5)
    chats = [system + tokens_for(300, seed=100 + i) for i in range(40)]
    for i, chat in enumerate(chats):
        store.save(prefill(model, chat)[0], chat, identity=identity, session=f"chat{i}")
    prompt = chats[17][:160] + [(chats[17][160] + 1) % 256, 9, 9, 9]
    hit = store.lookup(prompt, identity=identity)
    assert hit is not None and hit.entry.session == "chat17" and len(hit.tokens) == 160
    assert_continues_alike(model, hit.cache, prefill(model, prompt[:160])[0], prompt[160:])
    # a new chat with the same system prompt reuses exactly the system prompt
    fresh = system + [(chats[0][100] + 3) % 256] + tokens_for(20, seed=9)
    hit = store.lookup(fresh, identity=identity)
    assert hit is not None and len(hit.tokens) == 100


def test_prefixes_shorter_than_sixteen_tokens_never_hit(tiny: Any, store: persist.Store) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    stored, prompt = diverging(15, 300, 40)
    store.save(prefill(model, stored)[0], stored, identity=identity)
    assert store.lookup(prompt, identity=identity) is None


def test_a_hit_no_longer_than_what_the_caller_holds_is_not_read(
    tiny: Any, store: persist.Store
) -> None:
    model, tok, _ = tiny("llama")
    identity = persist.ModelIdentity.of(model, tok)
    stored, prompt = diverging(300, 400, 340)
    store.save(prefill(model, stored)[0], stored, identity=identity)
    assert store.lookup(prompt, identity=identity, longer_than=300) is None
    hit = store.lookup(prompt, identity=identity, longer_than=299)
    assert hit is not None and len(hit.tokens) == 300
