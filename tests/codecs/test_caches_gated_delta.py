"""GatedDeltaCache: knows its offset, persists bit-exactly, refuses pending padding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import persist
from persist.caches import GatedDeltaCache, make_cache
from tests.helpers import check_against_child, prefill, raw, run_child, tokens_for


def test_drop_in_for_qwen3_next(tiny: Any) -> None:
    model, _, _ = tiny("qwen3_next")
    cache = make_cache(model)
    assert [persist.kind_of(c) for c in cache] == ["gated-delta"] * 3 + ["kv"]
    toks = tokens_for(300, 1)
    _, got = prefill(model, toks, cache=cache, step=128)
    _, want = prefill(model, toks, cache=make_prompt_cache(model), step=128)
    assert raw(got) == raw(want)  # same arithmetic as mlx-lm's ArraysCache
    assert all(c.offset == 300 for c in cache[:3])
    assert cache[0].bytes_per_token() == 0 and not cache[0].is_trimmable()


def test_resumes_bit_exactly_in_a_fresh_process(tiny: Any, tmp_path: Path) -> None:
    model, _, model_dir = tiny("qwen3_next")
    toks = tokens_for(257, 2)
    cache, _ = prefill(model, toks, cache=make_cache(model), step=100)
    f, out = tmp_path / "g.safetensors", tmp_path / "g-out.safetensors"
    persist.save_file(f, cache, toks)
    run_child(model_dir, [{"file": str(f), "next": [5, 6, 7], "out": str(out)}], tmp_path)
    check_against_child(model, cache, out, toks, next_tokens=[5, 6, 7])
    restored = persist.load_file(f).cache
    assert type(restored[0]) is GatedDeltaCache and restored[0].offset == 257


def test_offsets_make_token_mismatches_detectable(tiny: Any, tmp_path: Path) -> None:
    model, _, _ = tiny("qwen3_next")
    toks = tokens_for(50, 3)
    cache, _ = prefill(model, toks, cache=make_cache(model))
    with pytest.raises(persist.NotResumableError, match="50 positions but 49 tokens"):
        persist.save_file(tmp_path / "x.safetensors", cache, toks[:-1])


def test_pending_padding_is_refused(tmp_path: Path) -> None:
    c = GatedDeltaCache(left_padding=[2, 0])
    c[0] = mx.zeros((2, 3, 8))
    c[1] = mx.zeros((2, 2, 4, 4))
    c.prepare(lengths=[5, 7])
    c.advance(7)
    assert c.offsets.tolist() == [3, 7]  # each row advances by its real positions
    with pytest.raises(persist.NotResumableError, match="finalize"):
        persist.save_file(tmp_path / "p.safetensors", [c])
    c.finalize()
    persist.save_file(tmp_path / "p.safetensors", [c])
    (back,) = persist.load_file(tmp_path / "p.safetensors").cache
    assert back.offsets.tolist() == [3, 7]


def _forward(model: Any, cache: list[Any], toks: list[int]) -> mx.array:
    out = model(mx.array([toks]), cache=cache)[0, -1]
    mx.eval(out, [c.state for c in cache])
    return out


@pytest.mark.parametrize("window", [1, 4])
def test_rollback_replays_exactly(window: int, tiny: Any) -> None:
    """Every keep from 0 to S equals, in state and next logits, a run on only those tokens."""
    import copy

    from tests.helpers import assert_same_state, live_state

    model, _, _ = tiny("qwen3_next")
    base = make_cache(model)
    prefill(model, tokens_for(70, 4), cache=base, step=32)
    draft = tokens_for(window, 5)
    for keep in range(window + 1):
        spec = copy.deepcopy(base)
        for c in spec:
            if isinstance(c, GatedDeltaCache):
                c.spec_round_begin()
        _forward(model, spec, draft)  # the verify forward
        for c in spec:
            if isinstance(c, GatedDeltaCache):
                c.spec_round_rollback(keep)
            else:
                c.trim(window - keep)
        ref = copy.deepcopy(base)
        if keep:
            _forward(model, ref, draft[:keep])
        assert_same_state(live_state(ref), live_state(spec))
        assert raw(_forward(model, ref, [9])) == raw(_forward(model, spec, [9]))


def test_commit_keeps_the_window_and_misuse_is_refused(tiny: Any, tmp_path: Path) -> None:
    import copy

    from tests.helpers import assert_same_state, live_state

    model, _, _ = tiny("qwen3_next")
    base = make_cache(model)
    prefill(model, tokens_for(40, 6), cache=base)
    plain = copy.deepcopy(base)
    gd = base[0]
    with pytest.raises(RuntimeError, match="no speculative round"):
        gd.spec_round_rollback(0)
    gd.spec_round_begin()
    with pytest.raises(RuntimeError, match="before the verify forward"):
        gd.spec_round_rollback(0)
    with pytest.raises(persist.NotResumableError, match="armed"):
        persist.save_file(tmp_path / "x.safetensors", base, tokens_for(40, 6))
    _forward(model, base, [1, 2, 3])
    with pytest.raises(ValueError, match="keep must be"):
        gd.spec_round_rollback(4)
    assert gd.round_armed  # a refused rollback leaves the round to resolve properly
    gd.spec_round_commit()
    assert not gd.round_armed
    _forward(model, plain, [1, 2, 3])
    assert_same_state(live_state(plain), live_state(base))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_prefill_equals_rows_alone(side: str, tiny: Any) -> None:
    """Rows of different lengths, padded: each row's state and logits equal it alone."""
    from mlx_lm.models.cache import BatchKVCache

    model, _, _ = tiny("qwen3_next")
    rows = [tokens_for(n, n) for n in (5, 40, 77)]
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    if side == "left":
        batch = [[0] * p + r for p, r in zip(pad, rows, strict=True)]
        cache = [
            GatedDeltaCache(left_padding=pad) if layer.is_linear else BatchKVCache(left_padding=pad)
            for layer in model.layers
        ]
    else:
        batch = [r + [0] * p for p, r in zip(pad, rows, strict=True)]
        cache = [
            GatedDeltaCache() if layer.is_linear else BatchKVCache([0] * 3)
            for layer in model.layers
        ]
        for c in cache:
            if isinstance(c, GatedDeltaCache):
                c.offsets = mx.zeros((3,), dtype=mx.int32)
                c.prepare(lengths=[len(r) for r in rows])
            else:
                c.prepare(lengths=[len(r) for r in rows], right_padding=pad)
    logits = model(mx.array(batch), cache=cache)
    mx.eval(logits)
    for c in cache:
        c.finalize()
    for i, r in enumerate(rows):
        alone = make_cache(model)
        want = model(mx.array([r]), cache=alone)[0, -1]
        last = len(r) - 1 if side == "right" else width - 1
        assert raw(logits[i, last]) == raw(want)
        for c, a in zip(cache, alone, strict=True):
            if isinstance(c, GatedDeltaCache):
                assert c.offsets.tolist()[i] == len(r) == a.offset
                for j in range(2):
                    assert raw(c.cache[j][i : i + 1]) == raw(a.cache[j])
