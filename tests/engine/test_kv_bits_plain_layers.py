"""Under an identity with kv_bits and quantized_kv_start S, mlx-lm converts every
convertible layer (KVCache; its rings cannot be) once a forward leaves it holding
S positions or more.  A plain layer holding S or more positions is therefore a
state no fresh run of that identity holds: it is never saved, never served from
a row an older persist wrote, never handed out from persist serve's memory, and
``persist.prefill`` under such an identity quantizes as mlx-lm does (a case from
an outside attack: checkpoints past S were plain and served)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

import persist
from persist.codecs.dispatch import serves_itself
from persist.codecs.snapshot import capture
from tests.helpers import NO_KV_BITS_HERE, ON_CUDA, prefill, tokens_for

BITS, GROUP, START = 4, 32, 20
pytestmark = pytest.mark.skipif(ON_CUDA, reason=NO_KV_BITS_HERE)


def _identity(model: Any, tok: Any, start: int = START) -> persist.ModelIdentity:
    return persist.ModelIdentity.of(
        model, tok, kv_bits=BITS, kv_group_size=GROUP, quantized_kv_start=start
    )


def _fresh(model: Any, toks: list[int], chunk: int) -> list[Any]:
    """A fresh run of ``toks`` fed in ``chunk``-token forwards, converted as mlx-lm's
    generate_step converts after every forward."""
    cache = make_prompt_cache(model)
    for i in range(0, len(toks), chunk):
        model(mx.array([toks[i : i + chunk]]), cache=cache)
        maybe_quantize_kv_cache(cache, START, GROUP, BITS)
    return cache


def test_plain_layers_past_the_start_are_refused_at_every_door(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(40, seed=3)
    plain, _ = prefill(model, toks)  # 40 plain positions: mlx-lm would hold them quantized
    ident = _identity(model, tok)
    path = tmp_path / "plain.safetensors"
    save_prompt_cache(str(path), plain)
    with persist.Store(tmp_path / "s") as store:
        for save in (
            lambda: store.save(plain, toks, identity=ident, session="p"),
            lambda: store.save(capture(plain, toks), toks, identity=ident, session="p"),
            lambda: store.checkpoint(plain, toks, identity=ident, session="p"),
            lambda: store.import_file(path, identity=ident, tokens=toks, model=model, session="p"),
        ):
            with pytest.raises(persist.IdentityMismatchError, match="quantized_kv_start=20"):
                save()
        assert store.sessions() == [] and store.stats().entries == 0
        short, _ = prefill(model, toks[: START - 1])  # below S: what a fresh run holds
        store.save(short, toks[: START - 1], identity=ident, session="short")


def test_prefill_under_a_kv_bits_identity_serves_what_a_fresh_run_holds(
    tiny: Any, tmp_path: Path
) -> None:
    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(64, seed=0)
    ident = _identity(model, tok)
    with persist.Store(tmp_path / "s") as store:
        persist.prefill(
            model, toks, store=store, identity=ident, session="doc", checkpoint_every=16
        )
        prompt = [*toks[:40], 7, 9]
        hit = store.lookup(prompt, identity=ident, max_cost=math.inf)
        assert hit is not None
        fresh = _fresh(model, list(hit.tokens), 16)
        assert [type(c).__name__ for c in hit.cache] == [type(c).__name__ for c in fresh]
        a = model(mx.array([[7]]), cache=hit.cache)[0, -1]
        b = model(mx.array([[7]]), cache=fresh)[0, -1]
        assert mx.array_equal(a, b)


def test_a_plain_row_an_older_persist_wrote_past_the_start_is_not_served(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row written before saves checked this (simulated: the check switched off)
    serves only what a fresh run holds, never its plain positions past S."""
    from persist.engine import layer_checks

    model, tok, _ = tiny("llama_hd64")
    toks = tokens_for(40, seed=3)
    plain, _ = prefill(model, toks)
    ident = _identity(model, tok)
    with persist.Store(tmp_path / "s") as store:
        with monkeypatch.context() as m:
            m.setattr(layer_checks, "refuse_plain_past_start", lambda *a, **k: None)
            store.save(plain, toks, identity=ident, session="old")
        hit = store.lookup([*toks, 5], identity=ident, max_cost=math.inf)
        assert hit is None or len(hit.tokens) < START


def test_memory_never_hands_out_plain_layers_past_the_start(tiny: Any) -> None:
    model, _, _ = tiny("llama_hd64")
    plain, _ = prefill(model, tokens_for(40, seed=3))
    assert serves_itself(plain, None)  # no kv_bits: a plain run holds exactly this
    assert not serves_itself(plain, START)
    assert serves_itself(plain, 41)
