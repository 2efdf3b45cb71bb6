"""The central test: save, load in a fresh process, continue bit for bit.

For every architecture family, prompts of awkward lengths are prefilled,
saved, restored in a subprocess, and both caches are fed the same next
tokens: logits, live state and 8 greedy tokens must be identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from tests.helpers import NEXT, check_against_child, kv_quantized, prefill, run_child, tokens_for

LENGTHS = [1, 255, 256, 257, 600]


def roundtrip(variant: str, tiny: Any, tmp: Path, build: Any, lengths: list[int]) -> None:
    model, _, model_dir = tiny(variant)
    jobs, originals = [], []
    for n in lengths:
        prompt = tokens_for(n, seed=n)
        cache = build(model, prompt)
        f, out = tmp / f"{variant}-{n}.safetensors", tmp / f"{variant}-{n}-out.safetensors"
        persist.save_file(f, cache, prompt)
        jobs.append({"file": str(f), "next": NEXT, "out": str(out)})
        originals.append((cache, out, prompt))
    run_child(model_dir, jobs, tmp)
    for cache, out, prompt in originals:
        check_against_child(model, cache, out, prompt)


def chunked(model: Any, prompt: list[int]) -> list[Any]:
    return prefill(model, prompt, step=100)[0]


@pytest.mark.parametrize(
    "variant", ["llama", "gemma3", "qwen3_next", "mamba2", "falcon_h1", "llama4"]
)
def test_family_roundtrip_in_fresh_process(variant: str, tiny: Any, tmp_path: Path) -> None:
    roundtrip(variant, tiny, tmp_path, chunked, LENGTHS)


def test_gemma3_ring_wrapped_by_decode_and_by_one_big_prefill(tiny: Any, tmp_path: Path) -> None:
    """Rings wrapped by single-token decode steps and by one long concat prefill."""

    def decode_wrapped(model: Any, prompt: list[int]) -> list[Any]:
        cache, _ = prefill(model, prompt[:20], step=20)
        for t in prompt[20:]:
            model(mx.array([[t]]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def one_shot(model: Any, prompt: list[int]) -> list[Any]:
        return prefill(model, prompt, step=len(prompt))[0]

    roundtrip("gemma3", tiny, tmp_path / "a", decode_wrapped, [70, 97]) if (
        (tmp_path / "a").mkdir() or True
    ) else None
    (tmp_path / "b").mkdir()
    roundtrip("gemma3", tiny, tmp_path / "b", one_shot, [300])


def test_gemma3_rings_actually_wrap(tiny: Any) -> None:
    model, _, _ = tiny("gemma3")
    cache = chunked(model, tokens_for(257))
    kinds = [persist.kind_of(c) for c in cache]
    assert kinds == ["rotating-kv", "rotating-kv", "kv"]
    assert all(not c.is_trimmable() for c in cache[:2])  # wrapped


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_kv_bits_converted_mid_prompt(bits: int, group: int, tiny: Any, tmp_path: Path) -> None:
    """mlx-lm's generate_step converts KVCache to QuantizedKVCache mid-prompt."""

    def quantized(model: Any, prompt: list[int]) -> list[Any]:
        return kv_quantized(model, prompt, len(prompt) // 2, bits, group)

    model, _, _ = tiny("llama_hd64")
    cache = quantized(model, tokens_for(300))
    assert [persist.kind_of(c) for c in cache] == ["quantized-kv"] * 2
    roundtrip("llama_hd64", tiny, tmp_path, quantized, [255, 300])
