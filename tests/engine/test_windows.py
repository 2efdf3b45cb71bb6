"""A ring (RotatingKVCache) is stored only under an identity whose model makes that ring.

mlx-lm makes rings two ways: ``make_prompt_cache(model, max_kv_size=N)`` for a
model without caches of its own (every layer a ring of N, keep 4), and a
model's own ``make_cache`` (gemma3's sliding-window layers, from its config;
``max_kv_size`` is then ignored).  A ring saved under an identity whose
caches are plain (or another window) would be handed to a user whose caches
attend to every position: every layer's window must be the identity's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import persist
from tests.helpers import prefill, tokens_for
from tests.trim_checks import diverging, hit_equals_prefill


def rings(model: Any, size: int, keep: int = 0) -> list[Any]:
    return [RotatingKVCache(max_size=size, keep=keep) for _ in model.layers]


@pytest.fixture(scope="module")
def qwen3() -> Any:
    """A tiny random qwen3: no make_cache of its own, so --max-kv-size makes rings
    (mlx-lm 0.32's llama has one: its caches ignore max_kv_size)."""
    import mlx.core as mx
    from mlx_lm.models import qwen3 as q

    mx.random.seed(3)
    args = q.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=256,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = q.Model(args)
    mx.eval(model.parameters())
    assert not hasattr(model, "make_cache")
    return model


@pytest.mark.parametrize("window", [None, 32])
def test_ring_under_another_window_is_refused(
    window: int | None, tiny: Any, store: persist.Store
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok, max_kv_size=window)
    toks = tokens_for(24)
    cache, _ = prefill(model, toks, cache=rings(model, 16), step=8)
    with pytest.raises(persist.IdentityMismatchError) as e:
        store.save(cache, toks, identity=ident, session="ring")
    assert e.value.fields == ["max_kv_size"]
    assert "16" in str(e.value) and f"max_kv_size={window}" in str(e.value)
    assert isinstance(e.value, ValueError)
    # nothing stored: the plain user (or the other window's) gets no ring
    assert store.lookup(toks + [1], identity=ident) is None
    assert store.sessions() == []


def test_ring_of_another_keep_is_refused(qwen3: Any, store: persist.Store) -> None:
    """mlx-lm's --max-kv-size rings keep 4 positions; a ring keeping none attends to
    other positions once it wraps."""
    model = qwen3
    ident = persist.ModelIdentity.of(model, max_kv_size=16)
    assert ident.windows == ((0, 16, 4), (1, 16, 4))
    toks = tokens_for(24)
    cache, _ = prefill(model, toks, cache=rings(model, 16, keep=0), step=8)
    with pytest.raises(persist.IdentityMismatchError, match="keep 0"):
        store.save(cache, toks, identity=ident)


def test_plain_layers_under_a_window_are_refused(qwen3: Any, store: persist.Store) -> None:
    """The other way round: full-attention layers served to a user whose ring forgets."""
    model = qwen3
    ident = persist.ModelIdentity.of(model, max_kv_size=16)
    toks = tokens_for(24)
    cache, _ = prefill(model, toks, cache=[KVCache() for _ in model.layers], step=8)
    with pytest.raises(persist.IdentityMismatchError, match="max_kv_size=16"):
        store.save(cache, toks, identity=ident)


def test_max_kv_size_rings_serve_their_own_identity(qwen3: Any, store: persist.Store) -> None:
    model = qwen3
    ident = persist.ModelIdentity.of(model, max_kv_size=48)
    stored, prompt = diverging(30, 40, 36)
    hit_equals_prefill(
        store,
        model,
        ident,
        lambda t: prefill(model, t, cache=make_prompt_cache(model, max_kv_size=48), step=8)[0],
        stored,
        prompt,
        30,
    )
    assert persist.ModelIdentity.of(model).digest != ident.digest


def test_a_model_with_its_own_caches_ignores_max_kv_size(tiny: Any) -> None:
    """As mlx-lm's make_prompt_cache: llama's make_cache makes plain layers whatever
    --max-kv-size says, so plain layers are what its identity expects."""
    model, tok, _ = tiny("llama")
    assert persist.ModelIdentity.of(model, tok, max_kv_size=16).windows == ()


@pytest.mark.parametrize("window", [None, 16])
def test_a_models_own_rings_keep_working(
    window: int | None, tiny: Any, store: persist.Store
) -> None:
    """gemma3's sliding-window layers come from its config (digested): saved and hit
    as before, with or without --max-kv-size (which mlx-lm ignores for it)."""
    model, tok, _ = tiny("gemma3")
    ident = persist.ModelIdentity.of(model, tok, max_kv_size=window)
    assert ident.windows, "the tiny gemma3 makes rings"
    stored, prompt = diverging(20, 29, 26)
    hit_equals_prefill(store, model, ident, lambda t: prefill(model, t)[0], stored, prompt, 20)


def test_a_models_own_rings_of_another_size_are_refused(tiny: Any, store: persist.Store) -> None:
    model, tok, _ = tiny("gemma3")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(12)
    cache = make_prompt_cache(model)
    layer, size, keep = ident.windows[0]
    cache[layer] = RotatingKVCache(max_size=size * 2, keep=keep)
    cache, _ = prefill(model, toks, cache=cache, step=4)
    with pytest.raises(persist.IdentityMismatchError, match=f"layer {layer}"):
        store.save(cache, toks, identity=ident)


def test_windows_survive_the_identity_map(tiny: Any) -> None:
    model, tok, _ = tiny("gemma3")
    ident = persist.ModelIdentity.of(model, tok)
    back = persist.ModelIdentity.from_dict(ident.to_dict())
    assert back.windows == ident.windows
    old = {k: v for k, v in ident.to_dict().items() if k != "windows"}
    assert persist.ModelIdentity.from_dict(old).windows is None  # unknown: no claim
    bad = {**ident.to_dict(), "windows": [[0, "16", 0]]}
    with pytest.raises(persist.InvalidArgumentError):
        persist.ModelIdentity.from_dict(bad)


def test_import_of_a_ring_file_under_a_plain_identity_is_refused(
    tiny: Any, store: persist.Store, tmp_path: Path
) -> None:
    """save_file writes what it is given; importing it is a save, checked alike."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(24)
    cache, _ = prefill(model, toks, cache=rings(model, 16, keep=4), step=8)
    path = tmp_path / "ring.persist"
    persist.save_file(path, cache, toks, identity=ident)
    with pytest.raises(persist.IdentityMismatchError, match="max_kv_size"):
        store.import_file(path, session="ring")
    assert store.sessions() == []


@pytest.mark.long  # three CLI processes
def test_generate_max_kv_size_rings_are_saved_and_resumed(tmp_path: Path) -> None:
    """``persist generate --max-kv-size`` on a model without caches of its own makes
    rings of that window (as mlx-lm): saved under that identity, wrapped and resumed;
    without the option the session is another identity's (refused by name)."""
    from persist.apps.demo import make_model
    from tests.helpers import persist_cli

    m = make_model(tmp_path / "q", "llama", overrides=QWEN3)
    home = tmp_path / "home"

    def gen(*args: str, check: bool = True) -> Any:
        return persist_cli(home, "generate", "--model", str(m), "--session", "w", *args,
                           "--max-tokens", "3", check=check)  # fmt: skip

    gen("--max-kv-size", "16", "--prompt", "x " * 20)  # 40 tokens: the ring wrapped
    gen("--max-kv-size", "16", "--prompt", " y")
    with persist.Store(home) as s:
        e = s.entry("w")
        assert set(e.kinds) == {"rotating-kv"} and e.tokens > 40
    other = gen("--prompt", " z", check=False)
    assert other.returncode != 0 and "max_kv_size" in other.stderr


QWEN3 = {"model_type": "qwen3", "max_position_embeddings": 4096}
