"""Batched caches from mlx-lm's BatchGenerator: the whole batch, and each row.

A row extracted from the batch, saved and restored in a fresh process, must
continue bit for bit like a single-sequence run of that row that saw its
tokens the same way (prompt minus its last token in one chunk, then one
token at a time, as the batch generator feeds them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, save_prompt_cache

import persist
from tests.helpers import (
    assert_same_state,
    check_against_child,
    live_state,
    prefill,
    raw,
    run_child,
    tokens_for,
)

PROMPTS = [tokens_for(5, 1), tokens_for(40, 2), tokens_for(77, 3)]


def run_batch(model: Any, steps: int = 6) -> tuple[BatchGenerator, list[int]]:
    gen = BatchGenerator(model, max_tokens=50)
    uids = gen.insert(PROMPTS)
    for _ in range(steps):
        gen.next()
    return gen, uids


def single_sequence(model: Any, prompt: list[int], tokens: list[int]) -> list[Any]:
    cache, _ = prefill(model, tokens[: len(prompt) - 1], step=4096)
    for t in tokens[len(prompt) - 1 :]:
        model(mx.array([[t]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("variant,kind", [("llama", "batch-kv"), ("gemma3", "batch-rotating-kv")])
def test_whole_batch_roundtrip(variant: str, kind: str, tiny: Any, tmp_path: Path) -> None:
    model, _, _ = tiny(variant)
    gen, _ = run_batch(model)
    batch = gen._generation_batch.prompt_cache
    assert persist.kind_of(batch[0]) == kind
    path = tmp_path / "batch.safetensors"
    persist.save_file(path, batch)
    restored = persist.load_file(path).cache
    assert_same_state(live_state(batch), live_state(restored))
    for step in range(4):
        inputs = mx.array([[11 + step], [7], [200]])
        a = model(inputs, cache=batch)
        b = model(inputs, cache=restored)
        assert raw(a) == raw(b), f"batch logits differ at step {step}"
    assert_same_state(live_state(batch), live_state(restored))


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_extracted_rows_continue_like_single_runs(variant: str, tiny: Any, tmp_path: Path) -> None:
    model, _, model_dir = tiny(variant)
    gen, uids = run_batch(model)
    rows = gen.extract_cache(uids)
    jobs, refs = [], []
    for uid, prompt in zip(uids, PROMPTS, strict=True):
        cache, tokens = rows[uid]
        f, out = tmp_path / f"row{uid}.safetensors", tmp_path / f"row{uid}-out.safetensors"
        persist.save_file(f, cache, tokens)
        jobs.append({"file": str(f), "next": [17, 200, 3, 99], "out": str(out)})
        refs.append((cache, single_sequence(model, prompt, tokens), out, tokens))
    run_child(model_dir, jobs, tmp_path)
    for row, single, out, tokens in refs:
        check_against_child(model, row, out, tokens)  # restored == extracted, state too
        check_against_child(model, single, out, tokens, state=False)  # == a single run


def _two_rows(cache: list[Any], n: int) -> list[Any]:
    """The same KV layers with the batch axis doubled (a file of a batch of 2)."""
    out = []
    for c in cache:
        k = KVCache()
        keys, values = c.keys[..., :n, :], c.values[..., :n, :]
        k.update_and_fetch(mx.concatenate([keys, keys]), mx.concatenate([values, values]))
        out.append(k)
    return out


def test_an_import_of_a_two_row_file_is_refused(tiny: Any, tmp_path: Path) -> None:
    """An mlx-lm file of a batch of 2 would serve one prompt's lookups with two rows
    (the next step fails in the model, or continues two sequences): refused, naming
    the layer and the file, and nothing is kept."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    cache, _ = prefill(model, toks)
    path = tmp_path / "b2.safetensors"
    save_prompt_cache(str(path), _two_rows(cache, 40))
    with persist.Store(tmp_path / "s") as store:
        with pytest.raises(persist.NotResumableError) as e:
            store.import_file(path, identity=ident, tokens=toks, model=model, session="x")
        assert "layer 0 (kv) holds a batch of 2 rows" in str(e.value) and str(path) in str(e.value)
        assert store.sessions() == [] and store.lookup([*toks, 7], identity=ident) is None


def test_a_save_of_a_batch_of_two_is_refused_for_every_serial_kind(
    tiny: Any, tmp_path: Path
) -> None:
    """Store.save (and save_file with tokens) of two rows: plain KV, quantized KV,
    a CacheList around them, recurrent state (also with unverified tokens, and as
    an mlx-lm import with --unverified-tokens); a one-row batch cache still saves."""
    from mlx_lm.models.cache import BatchKVCache, CacheList

    model, tok, _ = tiny("llama_hd64")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(40, seed=3)
    two = _two_rows(prefill(model, toks)[0], 40)
    q = [c.to_quantized(group_size=32, bits=4) for c in _two_rows(prefill(model, toks)[0], 40)]
    q_ident = persist.ModelIdentity.of(model, tok, kv_bits=4, kv_group_size=32)
    m_model, m_tok, _ = tiny("mamba2")
    m_ident = persist.ModelIdentity.of(m_model, m_tok)
    rec, _ = prefill(m_model, toks)
    for c in rec:
        c.cache = [mx.concatenate([a, a]) for a in c.cache]
    with persist.Store(tmp_path / "s") as store:
        for cache, who, kw in (
            (two, ident, {}),
            ([CacheList(c) for c in two], ident, {}),
            (q, q_ident, {}),
            (rec, m_ident, {}),
            (rec, m_ident, {"unverified_tokens": True}),
        ):
            with pytest.raises(persist.NotResumableError, match="holds a batch of 2 rows"):
                store.save(cache, toks, identity=who, session="b", **kw)
            with pytest.raises(persist.NotResumableError, match="holds a batch of 2 rows"):
                persist.save_file(tmp_path / "b.safetensors", cache, toks)
        path = tmp_path / "m2.safetensors"
        save_prompt_cache(str(path), rec)
        with pytest.raises(persist.NotResumableError, match=r"layer 0 \(arrays\) holds a batch"):
            store.import_file(path, identity=m_ident, tokens=toks, model=m_model,
                              session="m", unverified_tokens=True)  # fmt: skip
        assert store.sessions() == [] and store.stats().entries == 0
        one = []
        for c in prefill(model, toks)[0]:
            b = BatchKVCache(left_padding=[0])
            b.update_and_fetch(c.keys[..., :40, :], c.values[..., :40, :])
            one.append(b)
        store.save(one, toks, identity=ident, session="one")  # a batch of one: one sequence
        assert [e.session for e in store.sessions()] == ["one"]
