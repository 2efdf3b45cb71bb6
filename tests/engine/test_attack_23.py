"""Attacks on issue 23's fixes (never a wrong cache): each test failed before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import persist
from tests.helpers import assert_same_state, live_state, prefill, tokens_for


def test_an_unverified_session_exported_and_imported_elsewhere_stays_unverified(
    tiny: Any, tmp_path: Path
) -> None:
    """A persist-format export of an unverified session carries its tokens as if
    checked: imported into another store it must still serve no lookup."""
    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    out = tmp_path / "m.cache"
    with persist.Store(tmp_path / "a") as a:
        a.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        a.export("m", out)
    with persist.Store(tmp_path / "b") as b:
        b.import_file(out, identity=ident)
        assert b.entry("m").metadata["persist.unverified_tokens"] == "true"
        for prompt in ([*toks, 1], toks):
            assert b.lookup(prompt, identity=ident) is None
        got = b.restore("m", identity=ident)  # its own name still restores it
        assert_same_state(live_state(got.cache), live_state(cache))
        # the restored cache carries the mark (persist.marks): a caller's own cache
        # of those tokens, saved elsewhere, is checked, so the test can fail
        b.save(prefill(model, toks)[0], toks, identity=ident, session="checked")
        assert b.lookup([*toks, 1], identity=ident) is not None


def _fresh(model_dir: Any, variant: str) -> tuple[Any, Any, Path]:
    """Loaded as persist loads (stamped with its load provenance): the files'
    remembered digest is its identity until something changes it in memory."""
    from persist.provenance import load_model

    d = model_dir(variant)
    model, tok = load_model(d)[:2]
    return model, tok, d


def test_a_lora_adapter_fused_in_code_is_not_the_files_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """linear_to_lora_layers, trained (random lora_b), then fused back into plain
    Linear layers: same classes, dtypes and shapes as the files, other weights."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    model, tok, d = _fresh(model_dir, "llama")
    base = persist.ModelIdentity.of(model, tok, path=d)  # remembered
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    for _, m in model.named_modules():
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(1)) * 0.1
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest == hashed.digest


def test_a_cast_and_back_is_not_the_files_model(
    model_dir: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 -> fp16 -> bf16 rounds the weights: the files' digest no longer holds."""
    import mlx.core as mx

    monkeypatch.setenv("PERSIST_IDENTITY_CACHE", str(tmp_path / "memo"))
    model, tok, d = _fresh(model_dir, "llama")
    base = persist.ModelIdentity.of(model, tok, path=d)
    dtype = model.parameters()["model"]["embed_tokens"]["weight"].dtype
    model.set_dtype(mx.float16 if dtype != mx.float16 else mx.bfloat16)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    hashed = persist.ModelIdentity.of(model, tok)
    assert hashed.digest != base.digest
    assert persist.ModelIdentity.of(model, tok, path=d).digest == hashed.digest


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


def test_a_checkpoint_of_an_unverified_session_serves_no_lookup(tiny: Any, tmp_path: Path) -> None:
    """A checkpoint owned by an unverified session, of its tokens continued, begins
    with what nothing checked: it must not serve another prompt either."""
    from tests.helpers import NEXT, continue_run

    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=4)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        got = store.restore("m", identity=ident)
        _, greedy = continue_run(model, got.cache, NEXT)
        more = [*toks, *NEXT, *greedy]
        store.checkpoint(got.cache, more, identity=ident, session="m")
        assert store.lookup([*more, 5], identity=ident) is None
        store.checkpoint(got.cache, more, identity=ident, session="other")  # still marked
        assert store.lookup([*more, 5], identity=ident) is None
        fresh, _ = prefill(model, more)  # the caller's own cache of them: checked
        store.checkpoint(fresh, more, identity=ident, session="other")
        assert store.lookup([*more, 5], identity=ident) is not None


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


def test_a_turn_of_an_unverified_session_kept_under_name_2_stays_unverified(
    tiny: Any, tmp_path: Path
) -> None:
    """persist generate --session on an unverified session whose session another
    writer saved meanwhile keeps the turn as NAME~2: that one continues the
    unverified tokens too, and must serve no lookup."""
    from persist.apps.resume import resume_text, save_turn
    from tests.helpers import NEXT, continue_run

    model, tok, _ = tiny("mamba2")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=6)
    cache, _ = prefill(model, toks)
    with persist.Store(tmp_path / "s") as store:
        store.save(cache, toks, identity=ident, session="m", unverified_tokens=True)
        got = resume_text(store, "m", list(NEXT), ident, "default", None)
        store.save(cache, toks, identity=ident, session="m")  # another writer's turn
        assert got.cache is not None
        _, greedy = continue_run(model, got.cache, got.tokens[got.covered :])
        more = [*got.tokens, *greedy]
        name = save_turn(
            store, got.cache, more, identity=ident, session="m", namespace="default",
            version=got.version, unverified=got.unverified,
        )  # fmt: skip
        assert name == "m~2"
        assert store.entry("m~2").metadata["persist.unverified_tokens"] == "true"
        assert store.lookup([*more, 5], identity=ident) is None
