"""Partial reads: a lookup hit of k tokens opens only the blocks covering [0, k)
and the tail, and returns exactly a full restore trimmed to k, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from mlx_lm.models import cache as C

import persist
from persist.engine.partial import room_for
from persist.format.manifest import snapshot_specs
from tests.helpers import assert_same_state, kv_quantized, live_state, prefill, tokens_for
from tests.store_helpers import full_then_trim, whole_buffers

BLOCK = 16


def opened(store: persist.Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = store.blobs.open

    def spy(file: str) -> Any:
        seen.append(file)
        return real(file)

    monkeypatch.setattr(store.blobs, "open", spy)
    return seen


def floor(cache: list[Any], at: int) -> list[Any]:
    for c in cache:  # the conversion point, as a caller that knows it records it
        c.min_resume_offset = at
    return cache


FAMILIES: dict[str, tuple[str, Callable[[Any, list[int]], list[Any]], int, int]] = {
    # variant, build, stored tokens, hit length
    "kv": ("llama", lambda m, t: prefill(m, t)[0], 200, 40),
    "kv-exact-blocks": ("llama", lambda m, t: prefill(m, t)[0], 200, 48),
    "rotating-before-wrap": ("gemma3", lambda m, t: prefill(m, t)[0], 30, 17),
    "quantized": ("llama_hd64", lambda m, t: floor(kv_quantized(m, t, 0), 16), 200, 70),
    "chunked": (
        "llama4",
        lambda m, t: prefill(m, t, cache=[C.ChunkedKVCache(64) for _ in m.layers])[0],
        60,
        33,
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_partial_hit_is_a_full_restore_trimmed(
    family: str, tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    variant, build, n, k = FAMILIES[family]
    model, tok, _ = tiny(variant)
    kv_bits = {"kv_bits": 4, "kv_group_size": 32} if family == "quantized" else {}
    ident = persist.ModelIdentity.of(model, tok, **kv_bits)  # kv_quantized's defaults
    stored = tokens_for(n, seed=3)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(build(model, stored), stored, identity=ident, session="s")
        prompt = stored[:k] + [(stored[k] + 1) % 256, 5]
        row = store.index.get(info.id)
        assert row is not None
        blocks = [b.blob for b in store.index.blocks(info.id)]
        seen = opened(store, monkeypatch)
        hit = store.lookup(prompt, identity=ident)
        assert hit is not None and len(hit.tokens) == k
        want = -(-k // BLOCK)
        # the covering blocks, and the tail only if it holds an unsplit tensor (any order)
        assert sorted(f for f in seen if f != row.tail) == sorted(blocks[:want]), (seen, want)
        assert len(seen) <= want + 1
        trimmed = full_then_trim(store, "s", ident, k)
        assert_same_state(live_state(hit.cache), live_state(trimmed))
        # the same room past k, zeroed, as decoding a trimmed record gives
        assert whole_buffers(hit.cache) == whole_buffers(trimmed)


def test_a_hit_inside_the_tail_reads_everything_once(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(70, seed=4)  # 4 blocks and a 6-token tail
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(prefill(model, stored)[0], stored, identity=ident, session="s")
        seen = opened(store, monkeypatch)
        hit = store.lookup([*stored[:67], 1, 2], identity=ident)
        assert hit is not None and len(hit.tokens) == 67
        assert len(seen) == 70 // BLOCK + 1 == len(store.index.blocks(info.id)) + 1
        assert_same_state(live_state(hit.cache), live_state(full_then_trim(store, "s", ident, 67)))


def test_sizing_a_partial_read_computes_nothing(tiny: Any, tmp_path: Path) -> None:
    """The codecs size the buffers from never-evaluated placeholders of the whole
    snapshot: asking them allocates no tensor memory."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    stored = tokens_for(200, seed=5)
    with persist.Store(tmp_path / "s", block_tokens=BLOCK) as store:
        info = store.save(prefill(model, stored)[0], stored, identity=ident, session="s")
        row = store.index.get(info.id)
        assert row is not None
        body = msgpack.unpackb(row.manifest, raw=False)
    specs = snapshot_specs(body)
    mx.synchronize()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    room = room_for(specs, body["split"], 40, 48)
    assert room and all(n == 40 and cap == 256 for n, cap in room.values())
    assert mx.get_peak_memory() - active < info.bytes // 100  # a scalar, not the cache
