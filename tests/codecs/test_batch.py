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
