"""DelayedQuantizedKVCache: converts exactly at start, records its floor, resumes exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from persist.caches import DelayedQuantizedKVCache
from tests.helpers import check_against_child, raw, run_child, tokens_for

START = 200


def delayed(model: Any) -> list[Any]:
    return [DelayedQuantizedKVCache(START, bits=4, group_size=32) for _ in model.layers]


def test_converts_exactly_at_start(tiny: Any) -> None:
    model, _, _ = tiny("llama_hd64")
    cache = persist.prefill(model, tokens_for(300, 1), cache=delayed(model), step=128)
    assert all(c.converted_at == START and c.offset == 300 for c in cache)
    assert [persist.kind_of(c) for c in cache] == ["delayed-quantized(quantized-kv)"] * 2
    fresh = delayed(model)
    assert persist.kind_of(fresh[0]) == "delayed-quantized(kv)"
    assert fresh[0].max_append_tokens() == START
    with pytest.raises(ValueError, match="max_append_tokens"):
        model(mx.array([tokens_for(250, 2)]), cache=fresh)


@pytest.mark.parametrize("n,more", [(150, 80), (300, 12)])
def test_resumes_bit_exactly_on_both_sides(n: int, more: int, tiny: Any, tmp_path: Path) -> None:
    """Saved before the switch (and continued across it) or after it."""
    model, _, model_dir = tiny("llama_hd64")
    prompt = tokens_for(n, seed=n)
    cache = persist.prefill(model, prompt, cache=delayed(model), step=128)
    f, out = tmp_path / "d.safetensors", tmp_path / "d-out.safetensors"
    persist.save_file(f, cache, prompt)
    nxt = tokens_for(more, seed=7)
    run_child(model_dir, [{"file": str(f), "next": nxt, "out": str(out)}], tmp_path)
    check_against_child(model, cache, out, prompt, next_tokens=nxt)
    assert all(c.converted_at == START for c in cache)


def test_floor_is_the_conversion_offset(tiny: Any, tmp_path: Path) -> None:
    model, tok, _ = tiny("llama_hd64")
    identity = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)  # delayed's
    toks = tokens_for(500, 3)
    cache = persist.prefill(model, toks, cache=delayed(model), step=128)
    with persist.Store(tmp_path / "s") as store:
        entry = store.save(cache, toks, identity=identity, session="q")
        assert entry.min_resume_offset == START and entry.trimmable
        assert store.lookup(toks[:150] + tokens_for(40, 9), identity=identity) is None
        hit = store.lookup(toks[:320] + tokens_for(40, 9), identity=identity)
        assert hit is not None and len(hit.tokens) == 320
        ref = persist.prefill(model, toks[:320], cache=delayed(model), step=128)
        tail = tokens_for(40, 9)
        want = model(mx.array([tail]), cache=ref)
        got = model(mx.array([tail]), cache=hit.cache)
        assert raw(want) == raw(got)
        assert store.check() == []
