"""Incremental saves: a session saved again writes only the blocks whose bytes
changed since its last save or restore (from any Store object, in any process),
and still restores bit for bit.

The spy counts the blocks a save writes (``blob_writes._put`` with role block that
starts a blob write); every test also restores and compares, so a wrong reuse
cannot pass.  In-place writes and the property test: test_incremental_sound.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import persist
from persist.engine import blob_writes
from tests.helpers import (
    NEXT,
    assert_same_state,
    check_against_child,
    live_state,
    prefill,
    run_child,
    tokens_for,
)

BLOCK = 64


def written_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    seen: list[int] = []
    real = blob_writes._put

    def spy(index: Any, secret: Any, role: bytes, mats: Any, writes: Any) -> str:
        before = len(writes.jobs)  # every write this save started
        out = real(index, secret, role, mats, writes)
        if role == b"block" and len(writes.jobs) > before:
            seen.append(1)
        return out

    monkeypatch.setattr(blob_writes, "_put", spy)
    return seen


def _store(tmp: Path) -> persist.Store:
    return persist.Store(tmp / "s", block_tokens=BLOCK)


def test_turn_n_plus_1_writes_only_the_new_blocks(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, model_dir = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=80)  # 9 blocks and a tail
    cache, _ = prefill(model, toks)
    seen = written_blocks(monkeypatch)
    with _store(tmp_path) as store:
        store.save(cache, toks, identity=ident, session="chat")
        assert len(seen) == 9
        more = tokens_for(100, seed=81)  # the turn: 700 tokens, blocks 9 and 10 new
        prefill(model, more, cache=cache)
        seen.clear()
        before = store.stats().unique_bytes
        store.save(cache, [*toks, *more], identity=ident, session="chat")
        assert len(seen) == 1  # block 9 (positions 576..639); block 10 is the tail's
        grew = store.stats().unique_bytes - before
        assert 0 < grew < store.entry("chat").bytes // 4
        assert store.check() == []
    out = tmp_path / "out.safetensors"
    job = {"store": str(tmp_path / "s"), "session": "chat", "next": NEXT, "out": str(out)}
    run_child(model_dir, [job], tmp_path)
    check_against_child(model, cache, out, [*toks, *more])


def test_a_trim_into_a_block_and_the_same_tokens_again_is_saved_anew(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trimmed into block 4 and extended with the same tokens but other bytes (as
    another computation path gives, here made certain by scaling the keys): blocks
    4..8 are hashed and written again, and the restore is the cache in memory."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=82)
    cache, _ = prefill(model, toks, step=600)
    seen = written_blocks(monkeypatch)
    with _store(tmp_path) as store:
        store.save(cache, toks, identity=ident, session="chat")
        for c in cache:
            k, v = c.keys[..., 300:600, :], c.values[..., 300:600, :]
            c.trim(600 - 300)  # into block 4 (256..319)
            c.update_and_fetch(k * 1.5, v)
        mx.eval([c.state for c in cache])
        seen.clear()
        store.save(cache, toks, identity=ident, session="chat")
        assert len(seen) == 5  # blocks 4..8; 0..3 are unchanged and reused
        got = store.restore("chat", identity=ident)
        assert_same_state(live_state(got.cache), live_state(cache))
        # the same tokens recomputed one decode step at a time: whatever bytes that
        # gives, the restore is the cache in memory
        for c in cache:
            c.trim(600 - 300)
        for t in toks[300:]:
            model(mx.array([[t]]), cache=cache)
        mx.eval([c.state for c in cache])
        store.save(cache, toks, identity=ident, session="chat")
        got = store.restore("chat", identity=ident)
        assert_same_state(live_state(got.cache), live_state(cache))


def test_other_objects_sessions_or_kinds(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok, _ = tiny("llama_hd64")  # head dim 64: quantizable
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=83)
    cache, _ = prefill(model, toks)
    seen = written_blocks(monkeypatch)
    with _store(tmp_path) as store:
        store.save(cache, toks, identity=ident, session="chat")
        twin, _ = prefill(model, toks)  # the same bytes in other objects: nothing new
        seen.clear()
        store.save(twin, toks, identity=ident, session="chat")
        assert len(seen) == 0
        seen.clear()
        store.save(cache, toks, identity=ident, session="other")  # another session
        assert len(seen) == 0
        q = [c.to_quantized(group_size=32, bits=8) for c in twin]  # another kind: all new
        q_ident = persist.ModelIdentity.of(model, tok, kv_bits=8, kv_group_size=32)
        seen.clear()
        store.save(q, toks, identity=q_ident, session="q")
        assert len(seen) == 4
        assert_same_state(live_state(store.restore("q", identity=q_ident).cache), live_state(q))


def test_a_restored_session_saves_its_next_turn_incrementally(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``persist generate`` does each turn: restore, extend, save."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(600, seed=84)
    with _store(tmp_path) as store:
        store.save(prefill(model, toks)[0], toks, identity=ident, session="chat")
    seen = written_blocks(monkeypatch)
    with _store(tmp_path) as store:  # another process, as it were
        got = store.restore("chat", identity=ident)
        more = tokens_for(40, seed=85)
        prefill(model, more, cache=got.cache)
        store.save(got.cache, [*toks, *more], identity=ident, session="chat")
        assert len(seen) == 1  # block 9 only
        again = store.restore("chat", identity=ident)
        assert_same_state(live_state(again.cache), live_state(got.cache))


def test_blocks_collected_since_are_written_again(
    tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session's blob files died (deleted and collected, as another process's
    save or an eviction does): the save writes everything again."""
    model, tok, _ = tiny("llama")
    ident = persist.ModelIdentity.of(model, tok)
    toks = tokens_for(300, seed=86)
    cache, _ = prefill(model, toks)
    seen = written_blocks(monkeypatch)
    with _store(tmp_path) as store:
        store.save(cache, toks, identity=ident, session="chat")
        store.delete("chat")
        assert store.stats().unique_bytes == 0
        seen.clear()
        store.save(cache, toks, identity=ident, session="chat")
        assert len(seen) == 4  # everything
        assert store.check() == []
        got = store.restore("chat", identity=ident)
        assert_same_state(live_state(got.cache), live_state(cache))
