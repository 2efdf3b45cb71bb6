"""A cache is kept only under an identity whose options made it: a rotating ring only
under its max_kv_size, quantized layers only under their kv_bits and kv_group_size
and never before the identity's quantized_kv_start, at every door (save, captured
snapshot, checkpoint, mlx-lm import).  Otherwise a plain lookup would be served
layers that continue unlike a fresh prefill (cases from attacks on the identity)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import save_prompt_cache

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def test_a_rotating_file_is_refused_under_a_model_without_that_window(
    tiny: Any, tmp_path: Path
) -> None:
    """mlx_lm.cache_prompt --max-kv-size writes RotatingKVCache layers: imported for
    the model without max_kv_size, the ring (early tokens evicted) would be served
    to plain lookups and continue unlike a fresh prefill.  Refused; with the same
    max_kv_size it is still not what this model's own make_cache makes."""
    from mlx_lm.models.cache import RotatingKVCache, save_prompt_cache

    model, tok, _ = tiny("llama")
    ids = tokens_for(60, seed=7)
    ring, _ = prefill(model, ids, [RotatingKVCache(max_size=48) for _ in model.layers], step=8)
    path = tmp_path / "ring.safetensors"
    save_prompt_cache(str(path), ring)
    with persist.Store(tmp_path / "s") as store:
        plain = persist.ModelIdentity.of(model, tok)
        with pytest.raises(persist.IdentityMismatchError, match="window"):
            store.import_file(path, identity=plain, tokens=ids, model=model, session="r")
        assert store.sessions() == []
        windowed = persist.ModelIdentity.of(model, tok, max_kv_size=48)
        with pytest.raises(persist.IdentityMismatchError, match="window of 48"):
            store.import_file(path, identity=windowed, tokens=ids, model=model, session="r")
        assert store.sessions() == []
        kv, _ = prefill(model, ids)  # the model's own caches: imported, restored as saved
        save_prompt_cache(str(path), kv)
        store.import_file(path, identity=plain, tokens=ids, model=model, session="r")
        got = store.restore("r", identity=plain)
        assert_same_state(live_state(got.cache), live_state(kv))


def test_a_quantized_file_is_refused_under_an_identity_without_those_kv_bits(
    tiny: Any, tmp_path: Path
) -> None:
    """A generate --kv-bits cache file imported for the model without kv_bits would
    serve QuantizedKVCache layers to plain lookups (continuing unlike a fresh
    prefill): refused, and under other bits too; with its own settings it imports."""
    from mlx_lm.models.cache import save_prompt_cache

    from tests.helpers import kv_quantized

    model, tok, _ = tiny("llama_hd64")
    ids = tokens_for(40, seed=7)
    q = kv_quantized(model, ids, 0, bits=4, group=32)
    path = tmp_path / "q.safetensors"
    save_prompt_cache(str(path), q)
    with persist.Store(tmp_path / "s") as store:
        for cfg in ({}, {"kv_bits": 8, "kv_group_size": 32}, {"kv_bits": 4, "kv_group_size": 64}):
            other = persist.ModelIdentity.of(model, tok, **cfg)
            with pytest.raises(persist.IdentityMismatchError, match="kv_bits"):
                store.import_file(path, identity=other, tokens=ids, model=model, session="q")
            assert store.sessions() == []
        own = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)
        store.import_file(path, identity=own, tokens=ids, model=model, session="q")
        assert_same_state(live_state(store.restore("q", identity=own).cache), live_state(q))


def test_a_save_of_quantized_caches_under_a_plain_identity_is_refused(
    tiny: Any, tmp_path: Path
) -> None:
    """Quantized layers (also inside a CacheList, also as a captured snapshot, also
    by checkpoint) are saved only under an identity of their kv_bits and
    kv_group_size; plain layers under a kv_bits identity stay allowed."""
    from mlx_lm.models.cache import CacheList

    from persist.codecs.snapshot import capture
    from tests.helpers import kv_quantized

    model, tok, _ = tiny("llama_hd64")
    ids = tokens_for(40, seed=7)
    q = kv_quantized(model, ids, 0, bits=4, group=32)
    wrapped = [CacheList(c) for c in kv_quantized(model, ids, 0, bits=4, group=32)]
    with persist.Store(tmp_path / "s") as store:
        for cfg in ({}, {"kv_bits": 8, "kv_group_size": 32}, {"kv_bits": 4}):  # 4: group 64
            other = persist.ModelIdentity.of(model, tok, **cfg)
            for cache in (q, wrapped, capture(q, ids)):
                with pytest.raises(persist.IdentityMismatchError, match=r"layer 0.*kv_bits=4"):
                    store.save(cache, ids, identity=other, session="q")
            with pytest.raises(persist.IdentityMismatchError, match="kv_group_size=32"):
                store.checkpoint(q, ids, identity=other, session="q")
        assert store.sessions() == [] and store.stats().entries == 0
        own = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)
        store.save(q, ids, identity=own, session="q")
        store.save(wrapped, ids, identity=own, session="w")
        assert_same_state(live_state(store.restore("q", identity=own).cache), live_state(q))
        plain, _ = prefill(model, ids)  # not yet past quantized_kv_start: plain layers
        later = persist.ModelIdentity.of(model, tok, kv_bits=4, quantized_kv_start=100)
        store.save(plain, ids, identity=later, session="p")


def test_a_cache_quantized_before_the_identitys_start_is_not_served(
    tiny: Any, tmp_path: Path
) -> None:
    """Under kv_bits=4, quantized_kv_start=500 a fresh run of 102 tokens is still plain
    KV; a hit would hand out QuantizedKVCache layers (other logits from the first
    step): the save is refused, naming quantized_kv_start, and nothing serves."""
    from tests.helpers import kv_quantized

    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(100, seed=2)
    early = kv_quantized(model, toks, 0, bits=4, group=32)
    late = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32, quantized_kv_start=500)
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.IdentityMismatchError, match="quantized_kv_start"):
            store.save(early, toks, identity=late, session="q")
        assert store.lookup([*toks, 1, 2], identity=late) is None
        assert store.sessions() == [] and store.stats().entries == 0


def test_quantized_caches_and_the_identitys_start_at_every_door(tiny: Any, tmp_path: Path) -> None:
    """The early cache is refused at save (naming quantized_kv_start), as a captured
    snapshot, by checkpoint and as an mlx-lm import; mlx-lm itself quantizes a cache
    of exactly S positions (offset >= S): saved, restored by name, serving no prefix
    of S tokens, and its next turn (verified, not marked unverified) serves S + 1."""
    from persist.codecs.snapshot import capture
    from tests.helpers import assert_same_state, kv_quantized, live_state

    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(100, seed=2)
    early = kv_quantized(model, toks, 0, bits=4, group=32)
    q4 = {"kv_bits": 4, "kv_group_size": 32}
    late = persist.ModelIdentity.of(model, tok, **q4, quantized_kv_start=500)
    path = tmp_path / "early.safetensors"
    save_prompt_cache(str(path), early)
    with persist.Store(tmp_path / "s") as store:
        for save in (
            lambda: store.save(capture(early, toks), toks, identity=late, session="q"),
            lambda: store.checkpoint(early, toks, identity=late, session="q"),
            lambda: store.import_file(path, identity=late, tokens=toks, model=model, session="q"),
        ):
            with pytest.raises(persist.IdentityMismatchError, match="quantized_kv_start"):
                save()
        assert store.sessions() == [] and store.stats().entries == 0
        s = 64  # a file records no conversion point: quantized from 0 looks as from 64
        late = persist.ModelIdentity.of(model, tok, **q4, quantized_kv_start=s)
        at_start = kv_quantized(model, toks[:s], s, bits=4, group=32)
        assert {persist.kind_of(c) for c in at_start} == {"quantized-kv"}  # offset >= S
        entry = store.save(at_start, toks[:s], identity=late, session="q")
        assert entry.min_resume_offset == s + 1
        assert store.lookup([*toks[:s], 7], identity=late) is None
        got = store.restore("q", identity=late)
        assert_same_state(live_state(got.cache), live_state(at_start))
        more = toks[s : s + 8]
        model(mx.array([more]), cache=got.cache)
        turn = store.save(got.cache, toks[: s + 8], identity=late, session="q")
        assert "persist.unverified_tokens" not in turn.metadata
        hit = store.lookup([*toks[: s + 1], 7], identity=late)
        assert hit is not None and len(hit.tokens) == s + 1
        from persist.caches import DelayedQuantizedKVCache

        for start, ok in ((32, False), (s, True)):  # a delayed wrapper's conversion point
            wrapped = [DelayedQuantizedKVCache(start, bits=4, group_size=32) for _ in at_start]
            wrapped = persist.prefill(model, toks, cache=wrapped, step=128)
            assert all(c.converted_at == start for c in wrapped)
            if ok:
                store.save(wrapped, toks, identity=late, session=f"d{start}")
            else:
                with pytest.raises(persist.IdentityMismatchError, match="from 32 positions"):
                    store.save(wrapped, toks, identity=late, session=f"d{start}")
        loose = persist.ModelIdentity.of(model, tok, **q4)
        store.save(early, toks, identity=loose, session="e")  # names no start: no claim
