"""The host-RAM tier (``Store(root, host_cache=N)``) for every cache family: a hit,
trimmed or whole, equals the durable store's and continues as a fresh prefill does,
never aliases what was saved or handed out before, and an untrimmable cache serves
only its own length (cases from an attack on the host tier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import make_prompt_cache

import persist
from tests.engine.host_checks import GIB, durable, ident, same_continuation, scribble_all
from tests.helpers import (
    NEXT,
    assert_same_state,
    continue_run,
    kv_quantized,
    live_state,
    prefill,
    tokens_for,
)

# trimmable families: (variant, saved length, prefix asked); rings and chunks before they wrap
TRIMMABLE = [("llama", 100, 60), ("gemma3", 30, 20), ("llama4", 30, 20)]


@pytest.mark.parametrize(("variant", "n", "k"), TRIMMABLE)
def test_a_trimmed_hit_continued_in_place_leaves_the_entry(
    tiny: Any, tmp_path: Path, variant: str, n: int, k: int
) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(n, seed=21)
    cache, _ = prefill(model, toks)
    saved = live_state(cache)
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        short = store.lookup([*toks[:k], 250, 251], identity=identity)
        assert short is not None and short.source == "host" and short.tokens == toks[:k]
        fresh, _ = prefill(model, toks[:k])
        assert_same_state(live_state(short.cache), live_state(fresh))
        # continuing the short hit writes into its room past k: the kept n must not see it
        same_continuation(model, short.cache, fresh)
        full = store.lookup([*toks, 1], identity=identity)
        assert full is not None and full.source == "host" and full.tokens == toks
        assert_same_state(live_state(full.cache), saved)
        whole, _ = prefill(model, toks)
        same_continuation(model, full.cache, whole)


UNTRIMMABLE = [
    ("mamba2", 40),
    ("qwen3_next", 40),
    ("falcon_h1", 40),
    ("gemma3", 50),
    ("deepseek_v4_noindex", 40),
]


@pytest.mark.parametrize(("variant", "n"), UNTRIMMABLE)
def test_untrimmable_serve_only_their_own_length(
    tiny: Any, tmp_path: Path, variant: str, n: int
) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(n, seed=22)
    cache, _ = prefill(model, toks)
    root = tmp_path / "s"
    with persist.Store(root, host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        assert store.lookup([*toks[: n - 5], 9], identity=identity) is None
        assert store.lookup(toks[: n - 1], identity=identity) is None
        hit = store.lookup([*toks, 9], identity=identity)
        assert hit is not None and hit.source == "host"
        want = durable(root, [*toks, 9], identity)
        assert want is not None
        assert_same_state(live_state(hit.cache), live_state(want.cache))
        fresh, _ = prefill(model, toks)
        same_continuation(model, hit.cache, fresh)


@pytest.mark.parametrize("variant", ["mamba2", "falcon_h1", "gemma3", "llama4", "deepseek_v4"])
def test_no_alias_for_every_family(tiny: Any, tmp_path: Path, variant: str) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(40, seed=23)
    cache, _ = prefill(model, toks)
    saved = live_state(cache)
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        scribble_all(cache)
        continue_run(model, cache, NEXT, n_greedy=1)
        first = store.lookup([*toks, 3], identity=identity)
        assert first is not None and first.source == "host"
        assert_same_state(live_state(first.cache), saved)
        scribble_all(first.cache)
        second = store.lookup([*toks, 3], identity=identity)
        assert second is not None and second.source == "host"
        assert_same_state(live_state(second.cache), saved)
        fresh, _ = prefill(model, toks)
        same_continuation(model, second.cache, fresh)


def test_quantized_cache_no_alias_and_trim(tiny: Any, tmp_path: Path) -> None:
    cfg = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
    model, identity = ident(tiny, "llama_hd64", **cfg)
    toks = tokens_for(120, seed=24)
    cache = kv_quantized(model, toks, 0)
    saved = live_state(cache)
    root = tmp_path / "s"
    with persist.Store(root, host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        scribble_all(cache)
        hit = store.lookup([*toks, 3], identity=identity)
        assert hit is not None and hit.source == "host"
        assert_same_state(live_state(hit.cache), saved)
        short = store.lookup([*toks[:70], 3], identity=identity)
        want = durable(root, [*toks[:70], 3], identity)
        assert (short is None) == (want is None)
        if short is not None and want is not None:
            assert short.source == "host" and short.tokens == want.tokens
            assert_same_state(live_state(short.cache), live_state(want.cache))
            continue_run(model, short.cache, NEXT, n_greedy=2)
        again = store.lookup([*toks, 3], identity=identity)
        assert again is not None
        assert_same_state(live_state(again.cache), saved)
        # another kv_bits option never gets it
        _, plain = ident(tiny, "llama_hd64")
        assert store.lookup([*toks, 3], identity=plain) is None


def test_max_kv_size_is_an_identity_option(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama")
    ring = persist.ModelIdentity.of(model, tok, max_kv_size=64)
    plain = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=25)
    cache, _ = prefill(model, toks, cache=make_prompt_cache(model, max_kv_size=64))
    with persist.Store(tmp_path / "s", host_cache=GIB) as store:
        store.save(cache, toks, identity=ring)
        assert store.lookup([*toks, 1], identity=plain) is None
        hit = store.lookup([*toks[:30], 1], identity=ring)
        assert hit is not None and hit.source == "host"
        fresh, _ = prefill(model, toks[:30], cache=make_prompt_cache(model, max_kv_size=64))
        assert_same_state(live_state(hit.cache), live_state(fresh))
        same_continuation(model, hit.cache, fresh)


FAMILIES = [
    ("llama", 90),
    ("gemma3", 30),
    ("gemma3", 45),
    ("llama4", 30),
    ("llama4", 45),
    ("qwen3_next", 40),
    ("mamba2", 40),
    ("falcon_h1", 40),
    ("deepseek_v4_noindex", 40),
]


@pytest.mark.parametrize(("variant", "n"), FAMILIES)
def test_every_prefix_the_host_serves_is_the_durable_one(
    tiny: Any, tmp_path: Path, variant: str, n: int
) -> None:
    model, identity = ident(tiny, variant)
    toks = tokens_for(n, seed=27)
    cache, _ = prefill(model, toks)
    root = tmp_path / "s"
    with persist.Store(root, host_cache=GIB) as store:
        store.save(cache, toks, identity=identity)
        for k in sorted({n, n - 1, n - 2, (3 * n) // 4, n // 2 + 1, n // 2, 5}):
            prompt = [*toks[:k], 255, 254]
            hit = store.lookup(prompt, identity=identity)
            want = durable(root, prompt, identity)
            assert (hit is None) == (want is None), k
            if hit is None or want is None:
                continue
            assert hit.source == "host" and hit.tokens == want.tokens == toks[:k], k
            assert_same_state(live_state(hit.cache), live_state(want.cache))
            fresh, _ = prefill(model, toks[:k])
            same_continuation(model, hit.cache, fresh)
