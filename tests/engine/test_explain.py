"""``Store.explain``: each reason it gives, reproduced for real (tiny models, a real
store), and each checked against what ``Store.lookup`` really does; the bounded
explain (``bounded=True``, what persist serve runs) gives the same answer in each."""

from __future__ import annotations

from typing import Any

import pytest

import persist
from persist.engine.costs import LOCAL, LOCAL_DISK
from tests.helpers import ON_CUDA, kv_quantized, prefill, tokens_for


def ident(tiny: Any, variant: str, **cfg: Any) -> tuple[Any, Any, persist.ModelIdentity]:
    model, tok, _ = tiny(variant)
    return model, tok, persist.ModelIdentity.of(model, tok, **cfg)


def saved(store: persist.Store, model: Any, identity: Any, toks: list[int], name: str) -> None:
    store.save(prefill(model, toks, step=64)[0], toks, identity=identity, session=name)


def explained(store: persist.Store, prompt: list[int], **kw: Any) -> Any:
    """``store.explain``, and the bounded one (what persist serve runs) saying the same."""
    full = store.explain(prompt, **kw)
    near = store.explain(prompt, bounded=True, **kw)
    for got in (full, near):
        assert got.reason == full.reason, (got.message, full.message)
        assert (got.best.usable if got.best else 0) == (full.best.usable if full.best else 0)
        assert (got.longest.shared if got.longest else 0) == (
            full.longest.shared if full.longest else 0
        )
    return full


def agrees_with_lookup(store: persist.Store, prompt: list[int], identity: Any, usable: int) -> None:
    hit = store.lookup(prompt, identity=identity, max_cost=float("inf"))
    assert (0 if hit is None else len(hit.tokens)) == usable


def test_nothing_stored_is_empty(tiny: Any, store: persist.Store) -> None:
    _, _, identity = ident(tiny, "llama")
    got = explained(store, tokens_for(40), identity=identity)
    assert (got.reason, got.best, got.longest, got.nearest) == ("empty", None, None, [])


def test_a_full_hit_says_so(tiny: Any, store: persist.Store) -> None:
    model, tok, identity = ident(tiny, "llama")
    toks = tokens_for(96, 1)
    saved(store, model, identity, toks, "chat")
    prompt = toks + tokens_for(10, 2)
    got = explained(store, prompt, identity=identity, tokenizer=tok)
    assert got.reason == "hit" and got.best is not None
    assert (got.best.shared, got.best.usable, got.best.session) == (96, 96, "chat")
    assert got.best.prompt_next == prompt[96:100] and got.best.stored_next == []
    assert set(got.best.text) == {"before", "prompt_next", "stored_next"}
    agrees_with_lookup(store, prompt, identity, 96)


def test_divergence_is_located_with_context(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "llama")
    toks = tokens_for(80, 3)
    saved(store, model, identity, toks, "doc")
    prompt = toks[:50] + [(toks[50] + 1) % 256] + toks[51:]
    got = explained(store, prompt, identity=identity)
    near = got.nearest[0]
    assert (near.shared, near.usable, near.reason) == (50, 50, "hit")
    assert near.before == toks[46:50]
    assert near.prompt_next[0] != near.stored_next[0] == toks[50]
    agrees_with_lookup(store, prompt, identity, 50)


def test_another_identity_names_the_fields(tiny: Any, store: persist.Store) -> None:
    model, tok, plain = ident(tiny, "llama")
    toks = tokens_for(64, 4)
    saved(store, model, plain, toks, "chat")
    other = persist.ModelIdentity.of(model, tok, max_kv_size=4096)
    got = explained(store, toks + [5], identity=other)
    assert got.reason == "identity" and got.best is None
    assert got.longest is not None and got.longest.shared == 64
    assert got.longest.identity_fields == ["cache_config.max_kv_size"]
    agrees_with_lookup(store, toks + [5], other, 0)


def test_the_last_prompt_token_is_always_computed(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "llama")
    toks = tokens_for(64, 5)
    saved(store, model, identity, toks, "chat")
    got = explained(store, toks, identity=identity)
    assert got.reason == "last-token" and got.best is not None and got.best.usable == 63
    agrees_with_lookup(store, toks, identity, 63)


def test_recurrent_state_serves_only_its_own_length(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "mamba2")
    toks = tokens_for(48, 6)
    saved(store, model, identity, toks, "chat")
    prompt = toks[:30] + tokens_for(10, 7)
    got = explained(store, prompt, identity=identity)
    assert got.reason == "exact-only" and got.best is None
    assert got.longest is not None and "48 tokens" in got.longest.detail
    agrees_with_lookup(store, prompt, identity, 0)


@pytest.mark.skipif(ON_CUDA, reason="helpers.NO_KV_BITS_HERE")
def test_a_quantized_snapshot_has_a_floor(tiny: Any, store: persist.Store) -> None:
    cfg = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 100}
    model, _, identity = ident(tiny, "llama_hd64", **cfg)
    toks = tokens_for(160, 8)
    store.save(kv_quantized(model, toks, 100), toks, identity=identity, session="q")
    prompt = toks[:80] + tokens_for(20, 9)
    got = explained(store, prompt, identity=identity)
    assert got.reason == "floor" and got.best is None
    assert got.longest is not None and "quantized-kv" in got.longest.detail
    agrees_with_lookup(store, prompt, identity, 0)


@pytest.mark.skipif(ON_CUDA, reason="helpers.NO_KV_BITS_HERE")
def test_plain_layers_past_quantized_kv_start_are_named(
    tiny: Any, store: persist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row an older persist saved with layers still plain past quantized_kv_start
    (simulated: the save's check switched off) is passed over by the one servable
    rule lookups use, and explain names why."""
    from persist.engine import layer_checks

    cfg = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 20}
    model, _, identity = ident(tiny, "llama_hd64", **cfg)
    toks = tokens_for(40, 3)
    with monkeypatch.context() as m:
        m.setattr(layer_checks, "refuse_plain_past_start", lambda *a, **k: None)
        saved(store, model, identity, toks, "old")
    got = explained(store, toks + [5], identity=identity)
    assert (got.reason, got.best) == ("kv-bits-plain", None), got.message
    assert got.longest is not None and "quantized_kv_start 20" in got.longest.detail
    agrees_with_lookup(store, toks + [5], identity, 0)


def test_a_hit_the_cost_model_declines(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "llama")
    toks = tokens_for(96, 10)
    saved(store, model, identity, toks, "chat")
    # rates as if this machine restored at 1 KB/s and prefilled a million tokens a second
    for _ in range(8):  # enough samples to be confident
        for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
            for tier in (LOCAL, LOCAL_DISK):
                store.costs.restored(identity, tier, nbytes, nbytes / 1e3)
        store.costs.prefilled(identity, 0, 96, 96 / 1e6)
    prompt = toks + [1]
    got = explained(store, prompt, identity=identity)
    assert got.reason == "declined", got.message
    assert got.cost is not None and got.cost["restore"] is False
    assert store.lookup(prompt, identity=identity) is None  # the lookup declines it too


def test_a_damaged_row_is_named(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "llama")
    toks = tokens_for(64, 11)
    saved(store, model, identity, toks, "chat")
    with store.index.write() as db:  # a flipped field the row checksum must catch
        db.execute("UPDATE snapshots SET min_resume = min_resume + 7 WHERE name = 'chat'")
    got = explained(store, toks + [1], identity=identity)
    assert got.nearest[0].reason == "damaged" and got.best is None
    with store.index.write() as db:  # put it back, so the store is consistent again
        db.execute("UPDATE snapshots SET min_resume = min_resume - 7 WHERE name = 'chat'")


def test_other_namespaces_give_a_count_never_content(tiny: Any, store: persist.Store) -> None:
    model, _, identity = ident(tiny, "llama")
    toks = tokens_for(64, 12)
    store.save(prefill(model, toks, step=64)[0], toks, identity=identity, namespace="alice")
    got = explained(store, toks + [1], identity=identity, namespace="bob", other_namespaces=True)
    assert (got.reason, got.nearest, got.other_namespaces) == ("empty", [], 1)
    assert store.explain(toks + [1], identity=identity, namespace="bob").other_namespaces is None


def test_a_front_dropped_chunked_session_is_a_floor(tiny: Any, store: persist.Store) -> None:
    """The row's layers' rules (persist.servable) are the lookup's last word: explain
    asks them too, so a cut into a dropped chunk is named, never called usable."""
    from tests.engine.chunked_session import prompt_sharing, session

    _, _, ident, toks, cache = session(tiny)
    store.save(cache, toks, identity=ident)
    prompt = prompt_sharing(toks, 56)
    got = explained(store, prompt, identity=ident)
    assert got.reason == "floor" and got.best is None, got.message
    agrees_with_lookup(store, prompt, ident, 0)
